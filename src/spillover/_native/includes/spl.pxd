# C declarations of csrc/crc32c.h, csrc/frame.h, csrc/writer.h and csrc/section.h; no code here.
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len


cdef extern from "crc32c.h" nogil:
    uint32_t spl_crc32c(uint32_t crc, const void *data, size_t len)
    uint32_t spl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b)
    int spl_crc32c_hw()


cdef extern from "frame.h" nogil:
    enum:
        SPL_FORMAT_VERSION
        SPL_HEADER_SIZE
        SPL_FRAME_HEADER_SIZE
        SPL_TRAILER_BODY_SIZE
        SPL_TRAILER_SIZE
        SPL_MAX_PAYLOAD
        SPL_DATA
        SPL_EVENT
        SPL_CODEC_NONE
        SPL_CODEC_LZ4
        SPL_OK
        SPL_E_MAGIC
        SPL_E_VERSION
        SPL_E_HEADER
        SPL_E_FRAME_HEADER
        SPL_E_PAYLOAD_CRC
        SPL_E_TRAILER
        SPL_E_TRUNCATED
        SPL_E_IO

    ctypedef struct spl_state_header:
        uint16_t version
        uint64_t checkpoint_id
        uint32_t subtask_index
        uint32_t gate_id
        uint8_t gate_kind
        uint8_t codec
        uint8_t file_id[16]

    ctypedef struct spl_trailer:
        uint64_t frame_count
        uint64_t raw_bytes
        uint64_t stored_bytes
        uint8_t file_id[16]

    ctypedef struct spl_frame_ref:
        uint64_t payload
        uint32_t channel_id
        uint32_t stored_length
        uint32_t raw_length
        uint32_t payload_crc
        uint8_t data_type
        uint8_t codec
        uint8_t checked
    enum:
        SPL_CRC_UNCHECKED
        SPL_CRC_OK
        SPL_CRC_BAD

    void spl_encode_state_header(uint8_t *out, const spl_state_header *h)
    int spl_decode_state_header(const uint8_t *inp, spl_state_header *h)
    void spl_encode_trailer(uint8_t *out, const spl_trailer *t)
    int spl_decode_trailer(const uint8_t *inp, spl_trailer *t)
    int spl_scan_frames(const uint8_t *buf, size_t len, spl_frame_ref *out, size_t max_out,
                        int verify, size_t *n_out, size_t *consumed, size_t *err_at)


cdef extern from "writer.h" nogil:
    ctypedef int (*spl_sink_fn)(void *ctx, const iovec *iov, int n) noexcept
    ctypedef struct spl_writer:
        pass
    int spl_fd_write_all(int fd, const iovec *iov, int n)
    spl_writer *spl_writer_new(int fd, spl_sink_fn sink, void *sink_ctx, size_t batch_bytes,
                               size_t pool_bytes)
    int spl_writer_add(spl_writer *w, uint32_t channel_id, uint8_t data_type, uint8_t codec,
                       const void *payload, uint32_t stored_length, uint32_t raw_length,
                       int *flush_needed)
    int spl_writer_put_raw(spl_writer *w, const void *data, size_t len, int *flush_needed)
    enum:
        SPL_WRITER_SLOTS
    int spl_writer_submit(spl_writer *w)
    uint64_t spl_writer_submitted(spl_writer *w)
    uint64_t spl_writer_written(spl_writer *w)
    int spl_writer_flush(spl_writer *w)
    int spl_writer_finish(spl_writer *w, int do_fsync)
    int spl_writer_error(spl_writer *w, int *err_no)
    uint64_t spl_writer_bytes_written(spl_writer *w)
    void spl_writer_free(spl_writer *w)
    int spl_writer_running(spl_writer *w)
    int spl_writer_finish_is_quick(spl_writer *w, size_t max_bytes)
    void spl_writer_pool_stats(uint64_t *created, int *parked)


cdef extern from "section.h" nogil:
    enum:
        SPL_SECTION_CREATE
        SPL_SECTION_FSYNC
        SPL_SECTION_EMPTY
        SPL_PUBLISH_REPLACE
        SPL_STEP_MKDIR
        SPL_STEP_OPEN
        SPL_STEP_COPY
        SPL_STEP_FSYNC
        SPL_STEP_CLOSE
        SPL_STEP_RENAME
        SPL_STEP_LINK
        SPL_STEP_DIRSYNC
    ctypedef struct spl_section:
        int src
        int in_memory
        uint64_t count
        uint64_t at
        const void *extra
        size_t extra_len
        int emptied
    int spl_append_sections(const char *path, spl_section *sections, size_t n, int flags,
                            int *step, int *opened)
    int spl_copy_range(int src, int dst, uint64_t count, uint64_t at, int in_memory)
    int spl_write_new_file(const char *path, const void *data, size_t len, int flags, int *step)
    int spl_publish_file(const char *tmp, const char *path, const void *data, size_t len,
                         int flags, int *step)
    enum: SPL_PUBLISH_MAX
    int spl_publish_files(size_t n, const char *const *tmps, const char *const *paths,
                          const void *const *datas, const size_t *lens, const int *flags,
                          size_t *at, int *step)


cdef extern from "reader.h" nogil:
    ctypedef struct spl_block:
        uint8_t *data
        size_t cap
        size_t len
        uint64_t base
        spl_frame_ref *frames
        size_t nframes
        int refs

    spl_block *spl_block_new(size_t cap)
    void spl_block_incref(spl_block *b)
    void spl_block_decref(spl_block *b)
    int spl_block_scan(spl_block *b, size_t *consumed, size_t *need, size_t *err_at,
                       uint64_t *frames, uint64_t *raw, uint64_t *stored)

    ctypedef struct spl_reader:
        pass
    enum:
        SPL_READER_WAIT
        SPL_READER_DONE
    uint64_t SPL_READER_UNCHECKED
    void spl_block_check_payloads(spl_block *b)
    spl_reader *spl_reader_new(int fd, uint64_t start, uint64_t end, size_t block_bytes,
                               size_t max_queued, uint64_t expect_frames, uint64_t expect_raw,
                               uint64_t expect_stored, int verify)
    spl_block *spl_reader_next(spl_reader *r, int wait_ms, int *status, uint64_t *err_offset,
                               int *err_no)
    void spl_reader_free(spl_reader *r)

cdef extern from "wake.h" nogil:
    ctypedef struct spl_wake:
        pass
    ctypedef struct spl_credit:
        pass
    int spl_wake_init(spl_wake *w)
    void spl_wake_destroy(spl_wake *w)
    void spl_wake_post(spl_wake *w)
    void spl_wake_arm(spl_wake *w, int armed)
    int spl_wake_notify_armed(spl_wake *w)
    int spl_wake_wait(spl_wake *w, int64_t timeout_ms)
    uint64_t spl_wake_count(spl_wake *w)
    void spl_credit_init(spl_credit *c, int64_t initial)
    void spl_credit_add(spl_credit *c, int64_t delta)
    int spl_credit_take(spl_credit *c)
    int64_t spl_credit_get(const spl_credit *c)
    int64_t spl_credit_granted(const spl_credit *c)

cdef extern from "sockio.h" nogil:
    enum:
        SPL_SOCK_DONE
        SPL_SOCK_TIMEOUT
        SPL_SOCK_EOF
        SPL_SOCK_ERROR
        SPL_SOCK_NO_WAIT
    int spl_sock_read_frame(int fd, uint8_t *buf, size_t cap, size_t header, size_t length_at,
                            size_t *got, int whole_type_skip, int timeout_ms, int *err)
    int spl_sock_read_into(int fd, uint8_t *dst, size_t len, size_t *got, uint8_t *ahead,
                           size_t ahead_cap, size_t *ahead_got, int timeout_ms, int *err)
    int spl_sock_recv(int fd, uint8_t *buf, size_t cap, size_t *got, int timeout_ms, int *err)
    int spl_sock_send_now(int fd, const void *a, size_t alen, const void *b, size_t blen,
                          size_t *sent)
    enum:
        SPL_SOCK_FRAME
    int spl_sock_read_credit(int fd, uint8_t *buf, size_t cap, size_t *start, size_t *end,
                             uint8_t credit_type, uint32_t channel, spl_credit *credit,
                             spl_wake *credit_wake, spl_wake *output_wake, int timeout_ms,
                             int *err)
