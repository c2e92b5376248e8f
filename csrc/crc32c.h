/* CRC32C (Castagnoli): hardware SSE4.2 when the CPU has it, table otherwise. */
#ifndef SPL_CRC32C_H
#define SPL_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 for a fresh checksum) over `len` bytes; pre/post-conditioned
 * like every CRC32C, so spl_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t spl_crc32c(uint32_t crc, const void *data, size_t len);

/* CRC of A||B from crc(A), crc(B) and len(B). */
uint32_t spl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b);

/* 1 when the hardware path is in use. */
int spl_crc32c_hw(void);

#endif
