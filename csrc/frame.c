#include "frame.h"

#include <string.h>

#include "crc32c.h"

static const uint8_t MAGIC[8] = {0x89, 'S', 'P', 'L', '\r', '\n', 0x1a, '\n'};

static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t get64(const uint8_t *p) { return get32(p) | ((uint64_t)get32(p + 4) << 32); }

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

void spl_encode_state_header(uint8_t out[SPL_HEADER_SIZE], const spl_state_header *h) {
    memset(out, 0, SPL_HEADER_SIZE);
    memcpy(out, MAGIC, 8);
    put16(out + 8, SPL_FORMAT_VERSION);
    put16(out + 10, SPL_HEADER_SIZE);
    put64(out + 16, h->checkpoint_id);
    put32(out + 24, h->subtask_index);
    put32(out + 28, h->gate_id);
    out[32] = h->gate_kind;
    out[33] = h->codec;
    memcpy(out + 40, h->file_id, 16);
    put32(out + 60, spl_crc32c(0, out, 60));
}

int spl_decode_state_header(const uint8_t in[SPL_HEADER_SIZE], spl_state_header *h) {
    if (memcmp(in, MAGIC, 8) != 0) return SPL_E_MAGIC;
    h->version = get16(in + 8);
    if (h->version != SPL_FORMAT_VERSION) return SPL_E_VERSION;
    if (get16(in + 10) != SPL_HEADER_SIZE || get32(in + 12) != 0) return SPL_E_HEADER;
    if (!all_zero(in + 34, 6) || !all_zero(in + 56, 4)) return SPL_E_HEADER;
    if (in[32] > SPL_GATE_OUTPUT || in[33] > SPL_CODEC_LZ4) return SPL_E_HEADER;
    if (get32(in + 60) != spl_crc32c(0, in, 60)) return SPL_E_HEADER;
    h->checkpoint_id = get64(in + 16);
    h->subtask_index = get32(in + 24);
    h->gate_id = get32(in + 28);
    h->gate_kind = in[32];
    h->codec = in[33];
    memcpy(h->file_id, in + 40, 16);
    return SPL_OK;
}

void spl_encode_frame_header(uint8_t out[SPL_FRAME_HEADER_SIZE], const spl_frame_header *f) {
    put32(out, f->channel_id);
    out[4] = f->data_type;
    out[5] = f->codec;
    put16(out + 6, f->flags);
    put32(out + 8, f->stored_length);
    put32(out + 12, f->raw_length);
    put32(out + 16, f->payload_crc);
    put32(out + 20, spl_crc32c(0, out, 20));
}

/* Checks shared by data frames and the trailer's header. */
static int decode_header_raw(const uint8_t in[SPL_FRAME_HEADER_SIZE], spl_frame_header *f) {
    if (get32(in + 20) != spl_crc32c(0, in, 20)) return SPL_E_FRAME_HEADER;
    f->channel_id = get32(in);
    f->data_type = in[4];
    f->codec = in[5];
    f->flags = get16(in + 6);
    f->stored_length = get32(in + 8);
    f->raw_length = get32(in + 12);
    f->payload_crc = get32(in + 16);
    return SPL_OK;
}

int spl_decode_frame_header(const uint8_t in[SPL_FRAME_HEADER_SIZE], spl_frame_header *f) {
    int rc = decode_header_raw(in, f);
    if (rc) return rc;
    if (f->data_type > SPL_EVENT || f->flags != 0 || f->codec > SPL_CODEC_LZ4) return SPL_E_FRAME_HEADER;
    if (f->stored_length > SPL_MAX_PAYLOAD || f->raw_length > SPL_MAX_PAYLOAD) return SPL_E_FRAME_HEADER;
    if (f->codec == SPL_CODEC_NONE && f->raw_length != f->stored_length) return SPL_E_FRAME_HEADER;
    if (f->codec == SPL_CODEC_LZ4 && f->stored_length > f->raw_length) return SPL_E_FRAME_HEADER;
    return SPL_OK;
}

void spl_encode_trailer(uint8_t out[SPL_TRAILER_SIZE], const spl_trailer *t) {
    uint8_t *body = out + SPL_FRAME_HEADER_SIZE;
    put64(body, t->frame_count);
    put64(body + 8, t->raw_bytes);
    put64(body + 16, t->stored_bytes);
    memcpy(body + 24, t->file_id, 16);
    spl_frame_header f = {SPL_TRAILER_CHANNEL, SPL_TRAILER_TYPE, SPL_CODEC_NONE, 0,
                          SPL_TRAILER_BODY_SIZE, SPL_TRAILER_BODY_SIZE,
                          spl_crc32c(0, body, SPL_TRAILER_BODY_SIZE)};
    spl_encode_frame_header(out, &f);
}

int spl_decode_trailer(const uint8_t in[SPL_TRAILER_SIZE], spl_trailer *t) {
    spl_frame_header f;
    const uint8_t *body = in + SPL_FRAME_HEADER_SIZE;
    if (decode_header_raw(in, &f)) return SPL_E_TRAILER;
    if (f.channel_id != SPL_TRAILER_CHANNEL || f.data_type != SPL_TRAILER_TYPE || f.codec != 0 ||
        f.flags != 0 || f.stored_length != SPL_TRAILER_BODY_SIZE ||
        f.raw_length != SPL_TRAILER_BODY_SIZE)
        return SPL_E_TRAILER;
    if (f.payload_crc != spl_crc32c(0, body, SPL_TRAILER_BODY_SIZE)) return SPL_E_TRAILER;
    t->frame_count = get64(body);
    t->raw_bytes = get64(body + 8);
    t->stored_bytes = get64(body + 16);
    memcpy(t->file_id, body + 24, 16);
    return SPL_OK;
}

int spl_scan_frames(const uint8_t *buf, size_t len, spl_frame_ref *out, size_t max_out,
                    int verify, size_t *n_out, size_t *consumed, size_t *err_at) {
    size_t pos = 0, n = 0;
    while (n < max_out && len - pos >= SPL_FRAME_HEADER_SIZE) {
        spl_frame_header f;
        int rc = spl_decode_frame_header(buf + pos, &f);
        if (rc) {
            *err_at = pos;
            *n_out = n;
            *consumed = pos;
            return rc;
        }
        if (len - pos - SPL_FRAME_HEADER_SIZE < f.stored_length) break;
        const uint8_t *payload = buf + pos + SPL_FRAME_HEADER_SIZE;
        if (verify && spl_crc32c(0, payload, f.stored_length) != f.payload_crc) {
            *err_at = pos;
            *n_out = n;
            *consumed = pos;
            return SPL_E_PAYLOAD_CRC;
        }
        spl_frame_ref *r = &out[n++];
        r->payload = pos + SPL_FRAME_HEADER_SIZE;
        r->channel_id = f.channel_id;
        r->stored_length = f.stored_length;
        r->raw_length = f.raw_length;
        r->payload_crc = f.payload_crc;
        r->data_type = f.data_type;
        r->codec = f.codec;
        r->checked = verify ? SPL_CRC_OK : SPL_CRC_UNCHECKED;
        r->_pad = 0;
        pos += SPL_FRAME_HEADER_SIZE + f.stored_length;
    }
    *n_out = n;
    *consumed = pos;
    return SPL_OK;
}
