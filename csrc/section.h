/* Appending a finished section (a staged gate file) to a shared state file in one
 * call, and writing a small new file (a keyed-state file) in one call: open, in-kernel copy, optional fsync, close, and emptying the staged file
 * for reuse, so a caller that holds an interpreter lock releases it once. */
#ifndef SPL_SECTION_H
#define SPL_SECTION_H

#include <stddef.h>
#include <stdint.h>

/* flags */
#define SPL_SECTION_CREATE 1 /* make the file's directories and the file (O_EXCL) */
#define SPL_SECTION_FSYNC 2  /* fsync the file after the copy */
#define SPL_SECTION_EMPTY 4  /* afterwards truncate src to 0 bytes and rewind it */
#define SPL_SECTION_MEMORY 8 /* src is in memory (a memfd): copy_file_range would
                              * refuse it (EXDEV), so start with sendfile */

/* steps, as *step reports where it failed */
#define SPL_STEP_MKDIR 1
#define SPL_STEP_OPEN 2
#define SPL_STEP_COPY 3
#define SPL_STEP_FSYNC 4
#define SPL_STEP_CLOSE 5

/* Copies `count` bytes from offset 0 of `src` to offset `at` of the file at
 * `path` (copy_file_range, else sendfile, else pread and pwrite), then writes
 * `extra_len` bytes of `extra` (the section's index entry; none if 0) right
 * after them, at `at + count`, through the same descriptor. Returns 0, or
 * an errno value with *step the step that failed (EIO if src ends early).
 * *opened is 1 once the file was opened (created, with SPL_SECTION_CREATE).
 * *emptied is 1 if SPL_SECTION_EMPTY was asked and src is now empty at offset
 * 0; a failure to empty it is not an error. */
int spl_append_section(int src, const char *path, uint64_t count, uint64_t at,
                       const void *extra, size_t extra_len, int flags, int *step, int *opened,
                       int *emptied);

/* Writes `len` bytes of `data` as a new file at `path` in one call: its
 * directories made, the file created (O_EXCL: an existing one is EEXIST at
 * SPL_STEP_OPEN), written (SPL_STEP_COPY), fsynced with SPL_SECTION_FSYNC, and
 * closed. Returns 0, or an errno value with *step the step that failed; a file
 * left by a failed write is the caller's to remove. */
int spl_write_new_file(const char *path, const void *data, size_t len, int flags, int *step);

#endif
