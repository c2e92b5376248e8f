/* Read-ahead of state files. A reader thread pread()s blocks of a state
 * file's data region, scans their frames (header checksums) and queues them;
 * the consumer takes whole blocks. Blocks are reference counted: the reader's
 * pool, the queue, the consumer's batch and every buffer handed out that
 * points into a block each hold a reference, and a pooled block is reused only
 * when the pool's is the last. Nothing here touches Python. */
#ifndef SPL_READER_H
#define SPL_READER_H

#include <stddef.h>
#include <stdint.h>

#include "frame.h"

typedef struct spl_block {
    uint8_t *data;
    size_t cap;
    size_t len;            /* valid bytes */
    uint64_t base;         /* file offset of data[0] */
    spl_frame_ref *frames; /* whole frames found in data[0:len) */
    size_t nframes;
    size_t frames_cap;
    int refs;
    struct spl_block *next; /* ready-queue link */
    size_t alloc;           /* bytes allocated at data (cap or more: see bufcache.h) */
} spl_block;

spl_block *spl_block_new(size_t cap);
void spl_block_incref(spl_block *b);
void spl_block_decref(spl_block *b);

/* Scans b->data[0:len) into b->frames (growing it), headers checked. Returns
 * SPL_OK with *consumed and *need (the size of the next, partial frame when
 * its header is whole, else a frame header's size), or an error with *err_at
 * (offset in the block). Also adds the frames' sums to the totals. */
int spl_block_scan(spl_block *b, size_t *consumed, size_t *need, size_t *err_at,
                   uint64_t *frames, uint64_t *raw, uint64_t *stored);

typedef struct spl_reader spl_reader;

enum { SPL_READER_WAIT = -1, SPL_READER_DONE = -2 };

/* Checks the payload checksum of every frame of a scanned block and marks
 * each frame's `checked` (SPL_CRC_OK or SPL_CRC_BAD); the consumer raises at
 * a bad frame when it reaches it, so the frames before it still come out. */
void spl_block_check_payloads(spl_block *b);

/* Starts reading [start, end) of fd; the trailer's counts are checked at the
 * end unless expect_frames is SPL_READER_UNCHECKED (a byte range of the file,
 * whose reader counts its own frames). With `verify` the reader thread checks
 * payload checksums too, off the consumer's thread. Returns NULL when out of
 * memory or the thread cannot start. */
#define SPL_READER_UNCHECKED UINT64_MAX
spl_reader *spl_reader_new(int fd, uint64_t start, uint64_t end, size_t block_bytes,
                           size_t max_queued, uint64_t expect_frames, uint64_t expect_raw,
                           uint64_t expect_stored, int verify);

/* The next block (the caller owns a reference) or NULL with *status:
 * SPL_READER_WAIT (none ready within wait_ms; -1 waits forever),
 * SPL_READER_DONE, or an SPL_E_* code with *err_offset and *err_no. */
spl_block *spl_reader_next(spl_reader *r, int wait_ms, int *status, uint64_t *err_offset,
                           int *err_no);

/* Stops the thread and drops the reader's references. */
void spl_reader_free(spl_reader *r);

#endif
