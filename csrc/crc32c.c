/* CRC32C. The hardware path runs three independent streams so the crc32
 * instruction's 3-cycle latency is hidden, then merges them with the GF(2)
 * shift used by zlib's crc32_combine. */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static uint32_t x2n_table[32];
static int hw = -1;

static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P */
static uint32_t x2nmodp(size_t n, unsigned k) {
    uint32_t p = 1u << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static void init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
}

static uint32_t sw_update(uint32_t c, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPL_HAVE_HW 1
__attribute__((target("sse4.2"))) static uint32_t hw_update1(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64 = c;
    while (n && ((uintptr_t)p & 7)) {
        c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        n -= 8;
    }
    while (n--) c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
    return (uint32_t)c64;
}

/* Below this a single stream is as fast as three. */
#define STRIPE_MIN 1024

__attribute__((target("sse4.2"))) static uint32_t hw_update(uint32_t c, const uint8_t *p, size_t n) {
    if (n < 3 * STRIPE_MIN) return hw_update1(c, p, n);
    size_t stripe = (n / 3) & ~(size_t)7;
    const uint8_t *a = p, *b = p + stripe, *d = p + 2 * stripe;
    uint64_t ca = c, cb = 0xFFFFFFFFu, cd = 0xFFFFFFFFu;
    for (size_t i = 0; i < stripe; i += 8) {
        uint64_t wa, wb, wd;
        memcpy(&wa, a + i, 8);
        memcpy(&wb, b + i, 8);
        memcpy(&wd, d + i, 8);
        ca = __builtin_ia32_crc32di(ca, wa);
        cb = __builtin_ia32_crc32di(cb, wb);
        cd = __builtin_ia32_crc32di(cd, wd);
    }
    /* Streams b and d started from the conditioned seed; combine works on
     * final (xored) CRCs, so condition, combine, and uncondition. Buffer sizes
     * repeat, so the shift operator for the stripe length is cached. */
    static __thread size_t op_len;
    static __thread uint32_t op;
    if (op_len != stripe) {
        op = x2nmodp(stripe, 3);
        op_len = stripe;
    }
    uint32_t r = ~(uint32_t)ca;
    r = multmodp(op, r) ^ ~(uint32_t)cb;
    r = multmodp(op, r) ^ ~(uint32_t)cd;
    return hw_update1(~r, p + 3 * stripe, n - 3 * stripe);
}
#else
#define SPL_HAVE_HW 0
#endif

static void ensure_init(void) {
    if (hw >= 0) return;
    init_tables();
#if SPL_HAVE_HW
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    hw = 0;
#endif
}

int spl_crc32c_hw(void) {
    ensure_init();
    return hw;
}

uint32_t spl_crc32c(uint32_t crc, const void *data, size_t len) {
    ensure_init();
    uint32_t c = ~crc;
#if SPL_HAVE_HW
    if (hw) return ~hw_update(c, (const uint8_t *)data, len);
#endif
    return ~sw_update(c, (const uint8_t *)data, len);
}

uint32_t spl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b) {
    ensure_init();
    return multmodp(x2nmodp(len_b, 3), crc_a) ^ crc_b;
}
