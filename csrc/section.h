/* Appending a subtask's finished sections (staged gate files) to a shared state
 * file in one call, and writing a small new file (a keyed-state file) in one call: open, in-kernel copy, optional fsync, close, and emptying the staged file
 * for reuse, so a caller that holds an interpreter lock releases it once. */
#ifndef SPL_SECTION_H
#define SPL_SECTION_H

#include <stddef.h>
#include <stdint.h>

/* flags */
#define SPL_SECTION_CREATE 1 /* make the file's directories and the file (O_EXCL) */
#define SPL_SECTION_FSYNC 2  /* fsync the file after the copy */
#define SPL_SECTION_EMPTY 4   /* afterwards truncate src to 0 bytes and rewind it */
#define SPL_PUBLISH_REPLACE 8 /* spl_publish_file: replace an existing file (rename) */

/* steps, as *step reports where it failed */
#define SPL_STEP_MKDIR 1
#define SPL_STEP_OPEN 2
#define SPL_STEP_COPY 3
#define SPL_STEP_FSYNC 4
#define SPL_STEP_CLOSE 5
#define SPL_STEP_RENAME 6
#define SPL_STEP_LINK 7
#define SPL_STEP_DIRSYNC 8

/* One staged section to append (spl_append_sections). */
typedef struct spl_section {
    int src;           /* the staged file, copied from its offset 0 */
    int in_memory;     /* src is a memfd: copy_file_range would refuse it (EXDEV),
                        * so start with sendfile */
    uint64_t count;    /* its bytes */
    uint64_t at;       /* where they go in the file */
    const void *extra; /* the section's index entry, written right after it */
    size_t extra_len;  /* 0: none */
    int emptied;       /* out: SPL_SECTION_EMPTY was asked and src is empty now */
} spl_section;

/* Opens the file at `path` once (its directories and the file made, O_EXCL,
 * with SPL_SECTION_CREATE), copies each of the `n` sections to its place
 * (copy_file_range, else sendfile, else pread and pwrite) and writes its entry
 * after it, fsyncs once with SPL_SECTION_FSYNC, and closes it once. Returns 0,
 * or an errno value with *step the step that failed (EIO if a src ends early);
 * it stops at the first failure. *opened is 1 once the file was opened. With
 * SPL_SECTION_EMPTY and success, each src is then emptied and rewound (its
 * `emptied` says if it was; a failure to empty one is not an error). */
int spl_append_sections(const char *path, spl_section *sections, size_t n, int flags,
                        int *step, int *opened);

/* Copies `count` bytes from offset 0 of `src` to offset `at` of `dst`
 * (copy_file_range unless `in_memory`, else sendfile, else pread and pwrite);
 * 0 or an errno value (EIO if src ends early). */
int spl_copy_range(int src, int dst, uint64_t count, uint64_t at, int in_memory);

/* Writes `len` bytes of `data` as a new file at `path` in one call: its
 * directories made, the file created (O_EXCL: an existing one is EEXIST at
 * SPL_STEP_OPEN), written (SPL_STEP_COPY), fsynced with SPL_SECTION_FSYNC, and
 * closed. Returns 0, or an errno value with *step the step that failed; a file
 * left by a failed write is the caller's to remove. */
int spl_write_new_file(const char *path, const void *data, size_t len, int flags, int *step);

/* Publishes `len` bytes of `data` as the file `path` so that a reader sees all of
 * it or nothing, in one call: written as the new file `tmp` beside it (as
 * spl_write_new_file: directories made, fsynced with SPL_SECTION_FSYNC), then
 * renamed over `path` with SPL_PUBLISH_REPLACE, else hard-linked to it (an
 * existing `path` is EEXIST at SPL_STEP_LINK, never replaced) and `tmp` removed;
 * with SPL_SECTION_FSYNC the directory's entries are fsynced last
 * (SPL_STEP_DIRSYNC). Returns 0, or an errno value with *step the step that
 * failed; `tmp` is removed on any failure after it was made. */
int spl_publish_file(const char *tmp, const char *path, const void *data, size_t len, int flags,
                     int *step);

/* At most this many files per spl_publish_files call. */
#define SPL_PUBLISH_MAX 16

/* Publishes `n` files in order, each as spl_publish_file does (`flags[i]` its
 * SPL_SECTION_FSYNC and SPL_PUBLISH_REPLACE): file i becomes visible only after
 * files 0 to i-1 are, and with SPL_SECTION_FSYNC only after their directory
 * entries are durable. Every file's data is written first, its write-out started
 * at once (sync_file_range), and then each is fsynced: on a journaling filesystem
 * the first fsync's commit takes the others' data along, so their data costs one
 * commit where a spl_publish_file each costs one per file. Returns 0, or an errno
 * value (EINVAL: more than SPL_PUBLISH_MAX files) with *at the file and *step the
 * step that failed; the files before *at are published (and *at itself when its
 * directory's fsync failed), and no temporary file of a later one is left. */
int spl_publish_files(size_t n, const char *const *tmps, const char *const *paths,
                      const void *const *datas, const size_t *lens, const int *flags,
                      size_t *at, int *step);

#endif
