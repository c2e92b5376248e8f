#define _GNU_SOURCE
#include "section.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h> /* rename */
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK (1u << 20)

/* The directory holding `path` into buf (PATH_MAX bytes): "" for a name without a
 * slash, "/" for a name at the root; 0 or ENAMETOOLONG. */
static int parent_of(const char *path, char *buf) {
    size_t n = strlen(path);
    if (n >= PATH_MAX) return ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    char *slash = strrchr(buf, '/');
    if (!slash)
        buf[0] = '\0';
    else if (slash == buf)
        buf[1] = '\0';
    else
        *slash = '\0';
    return 0;
}

/* mkdir -p of the directory holding `path`; 0 or errno. */
static int make_parents(const char *path) {
    char buf[PATH_MAX];
    int bad = parent_of(path, buf);
    if (bad) return bad;
    if (buf[0] == '\0' || (buf[0] == '/' && buf[1] == '\0')) return 0;
    if (mkdir(buf, 0777) == 0 || errno == EEXIST) return 0;
    if (errno != ENOENT) return errno;
    for (char *p = buf + 1; *p; p++) { /* a parent is missing: make each in turn */
        if (*p != '/') continue;
        *p = '\0';
        int rc = mkdir(buf, 0777);
        *p = '/';
        if (rc != 0 && errno != EEXIST) return errno;
    }
    if (mkdir(buf, 0777) != 0 && errno != EEXIST) return errno;
    return 0;
}

int spl_copy_range(int src, int dst, uint64_t count, uint64_t at, int in_memory) {
    uint64_t done = 0;
    int in_kernel = !in_memory;
    while (done < count && in_kernel) {
        loff_t from = (loff_t)done, to = (loff_t)(at + done);
        size_t n = count - done > CHUNK * 64u ? CHUNK * 64u : (size_t)(count - done);
        ssize_t r = copy_file_range(src, &from, dst, &to, n, 0);
        if (r > 0) {
            done += (uint64_t)r;
        } else if (r == 0 || errno != EINTR) {
            /* Not supported here (EXDEV, ENOSYS, EINVAL...), or 0 where some
             * filesystems copy nothing: fall back; pread says if src is short. */
            in_kernel = 0;
        }
    }
    if (done < count && lseek(dst, (off_t)(at + done), SEEK_SET) >= 0) {
        while (done < count) {
            off_t from = (off_t)done;
            size_t n = count - done > CHUNK * 64u ? CHUNK * 64u : (size_t)(count - done);
            ssize_t r = sendfile(dst, src, &from, n);
            if (r > 0) {
                done += (uint64_t)r;
            } else if (r == 0 || errno != EINTR) {
                break; /* the last fallback decides */
            }
        }
    }
    if (done < count) {
        char *buf = malloc(CHUNK);
        if (!buf) return ENOMEM;
        int rc = 0;
        while (done < count && rc == 0) {
            size_t n = count - done > CHUNK ? CHUNK : (size_t)(count - done);
            ssize_t r = pread(src, buf, n, (off_t)done);
            if (r == 0) rc = EIO;
            if (r < 0 && errno != EINTR) rc = errno;
            for (ssize_t w = 0; r > 0 && w < r && rc == 0;) {
                ssize_t k = pwrite(dst, buf + w, (size_t)(r - w), (off_t)(at + done + (uint64_t)w));
                if (k > 0) w += k;
                else if (k == 0) rc = EIO;
                else if (errno != EINTR) rc = errno;
            }
            if (r > 0 && rc == 0) done += (uint64_t)r;
        }
        free(buf);
        if (rc) return rc;
    }
    return 0;
}

/* Writes all of `data` at offset `at` of `fd`; 0 or errno. */
static int pwrite_all(int fd, const void *data, size_t len, uint64_t at) {
    for (size_t done = 0; done < len;) {
        ssize_t w = pwrite(fd, (const char *)data + done, len - done, (off_t)(at + done));
        if (w > 0) done += (size_t)w;
        else if (w == 0) return EIO;
        else if (errno != EINTR) return errno;
    }
    return 0;
}

int spl_append_sections(const char *path, spl_section *sections, size_t n, int flags,
                        int *step, int *opened) {
    int oflags = O_WRONLY | O_CLOEXEC;
    int rc = 0;
    size_t i;
    *opened = 0;
    for (i = 0; i < n; i++) sections[i].emptied = 0;
    if (flags & SPL_SECTION_CREATE) {
        *step = SPL_STEP_MKDIR;
        if ((rc = make_parents(path))) return rc;
        oflags |= O_CREAT | O_EXCL;
    }
    *step = SPL_STEP_OPEN;
    int fd;
    do fd = open(path, oflags, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno;
    *opened = 1;
    *step = SPL_STEP_COPY;
    for (i = 0; i < n && rc == 0; i++) {
        spl_section *s = &sections[i];
        rc = spl_copy_range(s->src, fd, s->count, s->at, s->in_memory);
        if (rc == 0 && s->extra_len) rc = pwrite_all(fd, s->extra, s->extra_len, s->at + s->count);
    }
    if (rc == 0 && (flags & SPL_SECTION_FSYNC)) {
        *step = SPL_STEP_FSYNC;
        if (fsync(fd) != 0) rc = errno;
    }
    if (close(fd) != 0 && rc == 0 && errno != EINTR) {
        *step = SPL_STEP_CLOSE;
        rc = errno;
    }
    if (rc == 0 && (flags & SPL_SECTION_EMPTY))
        for (i = 0; i < n; i++)
            sections[i].emptied = ftruncate(sections[i].src, 0) == 0 &&
                                  lseek(sections[i].src, 0, SEEK_SET) == 0;
    return rc;
}

/* Makes the new file `path` (its directories first; O_EXCL) and writes `data` into
 * it: 0 with *fd open, or an errno value with *step the step that failed (*fd is -1
 * unless the file was opened). */
static int create_written(const char *path, const void *data, size_t len, int *fd, int *step) {
    int rc;
    *fd = -1;
    *step = SPL_STEP_MKDIR;
    if ((rc = make_parents(path))) return rc;
    *step = SPL_STEP_OPEN;
    do *fd = open(path, O_WRONLY | O_CLOEXEC | O_CREAT | O_EXCL, 0644);
    while (*fd < 0 && errno == EINTR);
    if (*fd < 0) return errno;
    *step = SPL_STEP_COPY;
    return pwrite_all(*fd, data, len, 0);
}

int spl_write_new_file(const char *path, const void *data, size_t len, int flags, int *step) {
    int fd;
    int rc = create_written(path, data, len, &fd, step);
    if (fd < 0) return rc;
    if (rc == 0 && (flags & SPL_SECTION_FSYNC)) {
        *step = SPL_STEP_FSYNC;
        if (fsync(fd) != 0) rc = errno;
    }
    if (close(fd) != 0 && rc == 0 && errno != EINTR) {
        *step = SPL_STEP_CLOSE;
        rc = errno;
    }
    return rc;
}

/* fsync of the directory holding `path`; 0 or errno. */
static int fsync_parent(const char *path) {
    char buf[PATH_MAX];
    int bad = parent_of(path, buf);
    if (bad) return bad;
    if (buf[0] == '\0') {
        buf[0] = '.';
        buf[1] = '\0';
    }
    int fd;
    do fd = open(buf, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno;
    int rc = fsync(fd) != 0 ? errno : 0;
    close(fd);
    return rc;
}

int spl_publish_file(const char *tmp, const char *path, const void *data, size_t len, int flags,
                     int *step) {
    size_t at;
    return spl_publish_files(1, &tmp, &path, &data, &len, &flags, &at, step);
}

/* Undoes what spl_publish_files made of files [from, made): each open one closed,
 * each temporary file removed. */
static void unmake(size_t from, size_t made, int *fds, const char *const *tmps) {
    for (size_t i = from; i < made; i++) {
        if (fds[i] >= 0) close(fds[i]);
        fds[i] = -1;
        unlink(tmps[i]);
    }
}

int spl_publish_files(size_t n, const char *const *tmps, const char *const *paths,
                      const void *const *datas, const size_t *lens, const int *flags,
                      size_t *at, int *step) {
    int fds[SPL_PUBLISH_MAX];
    size_t made = 0, published = 0, i;
    int rc = 0;
    *at = 0;
    *step = 0;
    if (n > SPL_PUBLISH_MAX) return EINVAL;
    /* 1. every file's data, its write-out started at once where it is to be synced */
    for (i = 0; i < n; i++) {
        *at = i;
        int fd;
        rc = create_written(tmps[i], datas[i], lens[i], &fd, step);
        if (fd >= 0) fds[made++] = fd;
        if (rc) goto fail;
        if (n > 1 && (flags[i] & SPL_SECTION_FSYNC)) /* a hint: the fsync is what counts */
            (void)sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    }
    /* 2. each file synced and closed: the first sync's commit takes the rest along */
    for (i = 0; i < n; i++) {
        *at = i;
        if (flags[i] & SPL_SECTION_FSYNC) {
            *step = SPL_STEP_FSYNC;
            if (fsync(fds[i]) != 0) {
                rc = errno;
                goto fail;
            }
        }
        *step = SPL_STEP_CLOSE;
        rc = close(fds[i]) != 0 && errno != EINTR ? errno : 0;
        fds[i] = -1;
        if (rc) goto fail;
    }
    /* 3. in order: each file visible (and its entry durable) before the next */
    for (i = 0; i < n; i++) {
        *at = i;
        if (flags[i] & SPL_PUBLISH_REPLACE) {
            *step = SPL_STEP_RENAME;
            if (rename(tmps[i], paths[i]) != 0) {
                rc = errno;
                goto fail;
            }
        } else {
            *step = SPL_STEP_LINK;
            if (link(tmps[i], paths[i]) != 0) {
                rc = errno;
                goto fail;
            }
            unlink(tmps[i]);
        }
        if (flags[i] & SPL_SECTION_FSYNC) {
            *step = SPL_STEP_DIRSYNC;
            if ((rc = fsync_parent(paths[i]))) {
                published = i + 1; /* visible: only the later ones are undone */
                goto fail;
            }
        }
        published = i + 1;
    }
    return 0;
fail:
    unmake(published, made, fds, tmps);
    return rc;
}
