/* Socket reads for the TCP transport, each
 * in one call: the wait for the socket and the transfer together, so a caller
 * that holds an interpreter lock lets it go once and takes it back once, where a
 * Python socket with a timeout polls, takes the lock back, then reads and takes
 * it back again (docs/network.md, "TCP transport"). */
#ifndef SPL_SOCKIO_H
#define SPL_SOCKIO_H

#include <stddef.h>
#include <stdint.h>

#include "wake.h"

/* statuses */
#define SPL_SOCK_DONE 0    /* what was asked is in */
#define SPL_SOCK_TIMEOUT 1 /* nothing came for the timeout: *got says what is in */
#define SPL_SOCK_EOF 2     /* the peer closed the connection: *got says what is in */
#define SPL_SOCK_ERROR 3   /* a system call failed: *err is its errno */
#define SPL_SOCK_FRAME 4   /* spl_sock_read_credit: a frame of another kind is next */

/* A timeout that never waits: read what is there now, then SPL_SOCK_TIMEOUT.
 * A caller holding an interpreter lock can make this call without letting the
 * lock go (no poll, only non-blocking reads), and wait only when it says so. */
#define SPL_SOCK_NO_WAIT (-2)

/* Reads the next frame's header (`header` bytes, the type in its first byte, the
 * payload's length a little-endian u32 at `length_at`) into `buf`, where *got
 * bytes of it already are, and then, unless its type is `whole_type_skip` or its
 * payload does not fit in `cap` - `header` bytes, its payload right after it:
 * waits (poll) for readability at most `timeout_ms` for each read (-1: no
 * limit; SPL_SOCK_NO_WAIT: not at all) and reads exactly what the frame still
 * needs, never a byte of the next frame. Returns a
 * status; *got is the bytes of buf filled, also on a timeout (call again with it
 * to go on) and at EOF. */
int spl_sock_read_frame(int fd, uint8_t *buf, size_t cap, size_t header, size_t length_at,
                        size_t *got, int whole_type_skip, int timeout_ms, int *err);

/* Fills `len` bytes of `dst`, where *got already are, letting every read run on
 * into `ahead` (`ahead_cap` bytes: the next frame's header), so a stream of
 * frames costs one read each. Waits like spl_sock_read_frame. *ahead_got is the
 * bytes of `ahead` filled once `dst` is full. */
int spl_sock_read_into(int fd, uint8_t *dst, size_t len, size_t *got, uint8_t *ahead,
                       size_t ahead_cap, size_t *ahead_got, int timeout_ms, int *err);

/* Reads what the socket holds, at most `cap` bytes, into `buf`, waiting like
 * spl_sock_read_frame when nothing is there yet: SPL_SOCK_DONE with *got > 0
 * bytes, or a status with *got 0 (a stream of small frames, read as it comes). */
int spl_sock_recv(int fd, uint8_t *buf, size_t cap, size_t *got, int timeout_ms, int *err);

/* One non-blocking vectored write of `a` then `b` (either may be empty;
 * MSG_DONTWAIT | MSG_NOSIGNAL): *sent is what the socket took now, 0 when it is
 * full or the call was interrupted. Never waits, so a caller may keep an
 * interpreter lock it holds. Returns 0 or errno. */
int spl_sock_send_now(int fd, const void *a, size_t alen, const void *b, size_t blen,
                      size_t *sent);

/* The transport's frame header (docs/network.md): type u8, flags u8 (0), reserved
 * u16 (0), channel u32, payload length u32, little-endian. */
#define SPL_FRAME_HEADER 12

/* A producer's credit reader, without an interpreter lock: reads the consumer's
 * CREDIT frames (type `credit_type`, channel `channel`, a u32 payload) into
 * `buf` (`cap` bytes; [*start, *end) holds bytes not yet parsed), and for each
 * read's credit adds it to `credit`, posts `credit_wake` (a producer blocked in
 * a send) and notifies `output_wake` if it is not NULL (a task waiting for its
 * output to move). Returns SPL_SOCK_FRAME as soon as a whole header that is not
 * such a CREDIT frame is at *start (the caller parses it), SPL_SOCK_TIMEOUT once
 * `timeout_ms` passed (also while credit flows: the caller looks around every
 * `timeout_ms`; 0 or SPL_SOCK_NO_WAIT: after one read of what is there),
 * SPL_SOCK_EOF or SPL_SOCK_ERROR. Bytes of a partial frame are
 * moved to the front of `buf`. */
int spl_sock_read_credit(int fd, uint8_t *buf, size_t cap, size_t *start, size_t *end,
                         uint8_t credit_type, uint32_t channel, spl_credit *credit,
                         spl_wake *credit_wake, spl_wake *output_wake, int timeout_ms, int *err);

#endif
