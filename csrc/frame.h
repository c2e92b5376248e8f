/* Format v1 of spillover state files: state header, frame headers, trailer,
 * and a scanner that validates the frames of a block. docs/format.md is the
 * byte-level spec; this file must agree with it. */
#ifndef SPL_FRAME_H
#define SPL_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define SPL_FORMAT_VERSION 1
#define SPL_HEADER_SIZE 64
#define SPL_FRAME_HEADER_SIZE 24
#define SPL_TRAILER_BODY_SIZE 40
#define SPL_TRAILER_SIZE (SPL_FRAME_HEADER_SIZE + SPL_TRAILER_BODY_SIZE)
#define SPL_MAX_PAYLOAD 0x7FFFFFFFu
#define SPL_TRAILER_CHANNEL 0xFFFFFFFFu

enum { SPL_DATA = 0, SPL_EVENT = 1, SPL_TRAILER_TYPE = 255 };
enum { SPL_CODEC_NONE = 0, SPL_CODEC_LZ4 = 1 };
enum { SPL_GATE_INPUT = 0, SPL_GATE_OUTPUT = 1 };

/* Result codes; 0 is success. */
enum {
    SPL_OK = 0,
    SPL_E_MAGIC = 1,        /* not a state file */
    SPL_E_VERSION = 2,      /* unknown format version */
    SPL_E_HEADER = 3,       /* state header fails checks */
    SPL_E_FRAME_HEADER = 4, /* frame header fails checks */
    SPL_E_PAYLOAD_CRC = 5,  /* payload checksum mismatch */
    SPL_E_TRAILER = 6,      /* trailer fails checks */
    SPL_E_TRUNCATED = 7,    /* frames do not tile the data region */
    SPL_E_IO = 8,           /* an I/O call failed; errno is kept */
};

typedef struct {
    uint16_t version;
    uint64_t checkpoint_id;
    uint32_t subtask_index;
    uint32_t gate_id;
    uint8_t gate_kind;
    uint8_t codec;
    uint8_t file_id[16];
} spl_state_header;

typedef struct {
    uint32_t channel_id;
    uint8_t data_type;
    uint8_t codec;
    uint16_t flags;
    uint32_t stored_length;
    uint32_t raw_length;
    uint32_t payload_crc;
} spl_frame_header;

typedef struct {
    uint64_t frame_count;
    uint64_t raw_bytes;
    uint64_t stored_bytes;
    uint8_t file_id[16];
} spl_trailer;

/* One frame found by spl_scan_frames: `payload` is the offset of the payload
 * from the start of the scanned block. */
typedef struct {
    uint64_t payload;
    uint32_t channel_id;
    uint32_t stored_length;
    uint32_t raw_length;
    uint32_t payload_crc;
    uint8_t data_type;
    uint8_t codec;
    uint8_t checked; /* SPL_CRC_*: whether the payload checksum was checked yet */
    uint8_t _pad;
} spl_frame_ref;

/* spl_frame_ref.checked */
enum { SPL_CRC_UNCHECKED = 0, SPL_CRC_OK = 1, SPL_CRC_BAD = 2 };

void spl_encode_state_header(uint8_t out[SPL_HEADER_SIZE], const spl_state_header *h);
int spl_decode_state_header(const uint8_t in[SPL_HEADER_SIZE], spl_state_header *h);

/* Writes the 24-byte header of a frame whose payload checksum is given. */
void spl_encode_frame_header(uint8_t out[SPL_FRAME_HEADER_SIZE], const spl_frame_header *f);
int spl_decode_frame_header(const uint8_t in[SPL_FRAME_HEADER_SIZE], spl_frame_header *f);

void spl_encode_trailer(uint8_t out[SPL_TRAILER_SIZE], const spl_trailer *t);
int spl_decode_trailer(const uint8_t in[SPL_TRAILER_SIZE], spl_trailer *t);

/* Scans the frames in buf[0:len). Stops at the first frame that is not whole
 * in the block, or when `max_out` frames are found. On success returns SPL_OK
 * with *n_out frames and *consumed bytes; on a bad frame returns the error and
 * sets *err_at to its offset in the block. Header checksums are always
 * verified, payload checksums when `verify` is non-zero (else the caller checks
 * each payload against `payload_crc` when it hands it out). */
int spl_scan_frames(const uint8_t *buf, size_t len, spl_frame_ref *out, size_t max_out,
                    int verify, size_t *n_out, size_t *consumed, size_t *err_at);

#endif
