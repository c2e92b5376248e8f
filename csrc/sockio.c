#include "sockio.h"

#include "records.h" /* spl_le32 */

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits for `events` on fd until `deadline` (ms, monotonic; -1: none). Returns 1
 * when ready (or in error or hung up: the next call says which), 0 on timeout,
 * -1 with errno on failure. */
static int wait_for(int fd, short events, int64_t deadline) {
    for (;;) {
        int left = -1;
        if (deadline >= 0) {
            int64_t d = deadline - now_ms();
            left = d < 0 ? 0 : (int)d;
        }
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int r = poll(&p, 1, left);
        if (r > 0)
            return 1;
        if (r == 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

/* One read of the iovecs, waiting for readability when none is there yet.
 * Returns the bytes read (> 0), or a status with *err set. */
static ssize_t read_some(int fd, struct iovec *iov, int iovcnt, int64_t deadline, int *status,
                         int *err) {
    for (;;) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)iovcnt;
        ssize_t n = recvmsg(fd, &m, MSG_DONTWAIT);
        if (n > 0)
            return n;
        if (n == 0) {
            *status = SPL_SOCK_EOF;
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            *status = SPL_SOCK_ERROR;
            return 0;
        }
        if (deadline == SPL_SOCK_NO_WAIT) { /* nothing more now, and no wait asked */
            *status = SPL_SOCK_TIMEOUT;
            return 0;
        }
        int w = wait_for(fd, POLLIN, deadline);
        if (w == 0) {
            *status = SPL_SOCK_TIMEOUT;
            return 0;
        }
        if (w < 0) {
            *err = errno;
            *status = SPL_SOCK_ERROR;
            return 0;
        }
    }
}

static int64_t deadline_of(int timeout_ms) {
    if (timeout_ms == SPL_SOCK_NO_WAIT)
        return SPL_SOCK_NO_WAIT;
    return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

int spl_sock_read_frame(int fd, uint8_t *buf, size_t cap, size_t header, size_t length_at,
                        size_t *got, int whole_type_skip, int timeout_ms, int *err) {
    int64_t deadline = deadline_of(timeout_ms);
    int status = SPL_SOCK_DONE;
    *err = 0;
    for (;;) {
        size_t need = header;
        if (*got >= header) {
            uint32_t len = spl_le32(buf + length_at);
            if (buf[0] != whole_type_skip && len <= cap - header)
                need += len;
        }
        if (*got >= need)
            return SPL_SOCK_DONE;
        struct iovec iov = {.iov_base = buf + *got, .iov_len = need - *got};
        ssize_t n = read_some(fd, &iov, 1, deadline, &status, err);
        if (n == 0)
            return status;
        *got += (size_t)n;
        deadline = deadline_of(timeout_ms); /* the wait is per read: bytes still coming */
    }
}

int spl_sock_read_into(int fd, uint8_t *dst, size_t len, size_t *got, uint8_t *ahead,
                       size_t ahead_cap, size_t *ahead_got, int timeout_ms, int *err) {
    int64_t deadline = deadline_of(timeout_ms);
    int status = SPL_SOCK_DONE;
    *err = 0;
    *ahead_got = 0;
    while (*got < len) {
        struct iovec iov[2] = {{.iov_base = dst + *got, .iov_len = len - *got},
                               {.iov_base = ahead, .iov_len = ahead_cap}};
        ssize_t n = read_some(fd, iov, ahead_cap ? 2 : 1, deadline, &status, err);
        if (n == 0)
            return status;
        if ((size_t)n > len - *got) {
            *ahead_got = (size_t)n - (len - *got);
            *got = len;
        } else {
            *got += (size_t)n;
        }
        deadline = deadline_of(timeout_ms); /* the wait is per read: bytes still coming */
    }
    return SPL_SOCK_DONE;
}

int spl_sock_recv(int fd, uint8_t *buf, size_t cap, size_t *got, int timeout_ms, int *err) {
    int status = SPL_SOCK_DONE;
    *err = 0;
    *got = 0;
    if (cap == 0)
        return SPL_SOCK_DONE;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
    ssize_t n = read_some(fd, &iov, 1, deadline_of(timeout_ms), &status, err);
    if (n == 0)
        return status;
    *got = (size_t)n;
    return SPL_SOCK_DONE;
}

int spl_sock_read_credit(int fd, uint8_t *buf, size_t cap, size_t *start, size_t *end,
                         uint8_t credit_type, uint32_t channel, spl_credit *credit,
                         spl_wake *credit_wake, spl_wake *output_wake, int timeout_ms, int *err) {
    int64_t deadline = deadline_of(timeout_ms);
    int no_wait = timeout_ms == SPL_SOCK_NO_WAIT || timeout_ms == 0, read = 0;
    *err = 0;
    for (;;) {
        int64_t delta = 0;
        int other = 0;
        while (*end - *start >= SPL_FRAME_HEADER) {
            const uint8_t *h = buf + *start;
            if (h[0] != credit_type || h[1] || h[2] || h[3] || spl_le32(h + 4) != channel ||
                spl_le32(h + 8) != 4) {
                other = 1;
                break;
            }
            if (*end - *start < SPL_FRAME_HEADER + 4)
                break;
            delta += spl_le32(h + SPL_FRAME_HEADER);
            *start += SPL_FRAME_HEADER + 4;
        }
        if (delta) {
            spl_credit_add(credit, delta);
            spl_wake_post(credit_wake);
            if (output_wake)
                spl_wake_notify_armed(output_wake);
        }
        if (other)
            return SPL_SOCK_FRAME;
        if (*start) { /* a partial frame moves to the front */
            memmove(buf, buf + *start, *end - *start);
            *end -= *start;
            *start = 0;
        }
        if (*end >= cap) { /* never: a CREDIT frame is 16 bytes, the buffer far more */
            *err = EMSGSIZE;
            return SPL_SOCK_ERROR;
        }
        /* No wait at all: one pass over what is there, then SPL_SOCK_TIMEOUT. */
        int left = -1;
        if (no_wait) {
            if (read)
                return SPL_SOCK_TIMEOUT;
            left = SPL_SOCK_NO_WAIT;
        } else if (deadline >= 0) {
            int64_t d = deadline - now_ms();
            if (d <= 0)
                return SPL_SOCK_TIMEOUT;
            left = (int)d;
        }
        size_t got = 0;
        int status = spl_sock_recv(fd, buf + *end, cap - *end, &got, left, err);
        read = 1;
        if (status != SPL_SOCK_DONE)
            return status;
        *end += got;
    }
}

int spl_sock_send_now(int fd, const void *a, size_t alen, const void *b, size_t blen,
                      size_t *sent) {
    struct iovec iov[2];
    int n = 0;
    if (alen) iov[n++] = (struct iovec){(void *)a, alen};
    if (blen) iov[n++] = (struct iovec){(void *)b, blen};
    *sent = 0;
    if (!n) return 0;
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)n;
    ssize_t r = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) {
        *sent = (size_t)r;
        return 0;
    }
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : errno;
}
