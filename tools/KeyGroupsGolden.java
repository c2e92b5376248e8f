// Writes the golden key-group files of tests/golden/keygroups/.
//
// Run from the repository root:  java tools/KeyGroupsGolden.java [out-dir]
//
// The hash codes come from the JVM itself (Integer.hashCode, Long.hashCode,
// String.hashCode, Arrays.hashCode, new String(bytes, UTF_8)); the murmur hash
// and the key-group assignment are written out below from Flink's algorithm
// (MathUtils.murmurHash, KeyGroupRangeAssignment.computeKeyGroupForKeyHash).
// Keys come from a seeded java.util.Random, whose sequence the JDK specifies,
// and are written into the files, so no reader needs a generator of its own.

import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStreamWriter;
import java.io.Writer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Random;
import java.util.Set;
import java.util.zip.GZIPOutputStream;

public class KeyGroupsGolden {
    static final int[] MAX_PARALLELISMS = {128, 1000, 32768};
    static final int KEYS_PER_FILE = 10_000;
    static final int BYTE_KEYS_PER_FILE = 5_000;
    static final long SEED = 0x5EED_2024L;

    /** Flink's MathUtils.murmurHash(int): non-negative. */
    static int murmurHash(int code) {
        code *= 0xcc9e2d51;
        code = Integer.rotateLeft(code, 15);
        code *= 0x1b873593;
        code = Integer.rotateLeft(code, 13);
        code = code * 5 + 0xe6546b64;
        code ^= 4;
        code ^= code >>> 16;
        code *= 0x85ebca6b;
        code ^= code >>> 13;
        code *= 0xc2b2ae35;
        code ^= code >>> 16;
        if (code >= 0) {
            return code;
        } else if (code != Integer.MIN_VALUE) {
            return -code;
        } else {
            return 0;
        }
    }

    interface Row {
        String key();

        int hash();
    }

    static void write(Path dir, String name, List<? extends Row> rows) throws IOException {
        Path file = dir.resolve(name + ".csv.gz");
        try (Writer w =
                new OutputStreamWriter(
                        new GZIPOutputStream(new FileOutputStream(file.toFile())),
                        StandardCharsets.US_ASCII)) {
            StringBuilder sb = new StringBuilder("key,hash,murmur");
            for (int p : MAX_PARALLELISMS) sb.append(",kg").append(p);
            w.write(sb.append('\n').toString());
            for (Row r : rows) {
                int m = murmurHash(r.hash());
                sb.setLength(0);
                sb.append(r.key()).append(',').append(r.hash()).append(',').append(m);
                for (int p : MAX_PARALLELISMS) sb.append(',').append(m % p);
                w.write(sb.append('\n').toString());
            }
        }
        System.out.println(file + ": " + rows.size() + " keys");
    }

    static String hex(byte[] b) {
        StringBuilder sb = new StringBuilder(2 * b.length);
        for (byte x : b) sb.append(Character.forDigit((x >> 4) & 15, 16)).append(Character.forDigit(x & 15, 16));
        return sb.toString();
    }

    record IntRow(int v) implements Row {
        public String key() { return Integer.toString(v); }
        public int hash() { return Integer.valueOf(v).hashCode(); }
    }

    record LongRow(long v) implements Row {
        public String key() { return Long.toString(v); }
        public int hash() { return Long.valueOf(v).hashCode(); }
    }

    /** A String key, written as the hex of its UTF-8 bytes. */
    record StrRow(String s) implements Row {
        public String key() { return hex(s.getBytes(StandardCharsets.UTF_8)); }
        public int hash() { return s.hashCode(); }
    }

    /** A byte[] key: java.util.Arrays.hashCode (signed bytes). */
    record BytesRow(byte[] b) implements Row {
        public String key() { return hex(b); }
        public int hash() { return Arrays.hashCode(b); }
    }

    /** Arbitrary bytes read as a UTF-8 String by Java's decoder (malformed input replaced). */
    record Utf8Row(byte[] b) implements Row {
        public String key() { return hex(b); }
        public int hash() { return new String(b, StandardCharsets.UTF_8).hashCode(); }
    }

    static List<IntRow> int32Keys(Random rnd) {
        Set<Integer> keys = new LinkedHashSet<>();
        for (int v : new int[] {0, 1, -1, 42, -42, Integer.MIN_VALUE, Integer.MAX_VALUE,
                Integer.MIN_VALUE + 1, Integer.MAX_VALUE - 1}) keys.add(v);
        for (int k = 0; k < 32; k++) {
            keys.add(1 << k);
            keys.add(-(1 << k));
            keys.add((1 << k) - 1);
        }
        for (int v = -1000; v <= 1000; v++) keys.add(v);
        while (keys.size() < KEYS_PER_FILE) keys.add(rnd.nextInt());
        List<IntRow> rows = new ArrayList<>();
        for (int v : keys) rows.add(new IntRow(v));
        return rows;
    }

    static List<LongRow> int64Keys(Random rnd) {
        Set<Long> keys = new LinkedHashSet<>();
        for (long v : new long[] {0, 1, -1, 42, -42, Long.MIN_VALUE, Long.MAX_VALUE,
                Long.MIN_VALUE + 1, Long.MAX_VALUE - 1, Integer.MIN_VALUE, Integer.MAX_VALUE,
                (long) Integer.MIN_VALUE - 1, (long) Integer.MAX_VALUE + 1, 0xFFFFFFFFL,
                0x1_0000_0000L, -0x1_0000_0000L, 0xFFFFFFFF_00000000L, 0x00000001_00000001L})
            keys.add(v);
        for (int k = 0; k < 64; k++) {
            keys.add(1L << k);
            keys.add(-(1L << k));
            keys.add((1L << k) - 1);
        }
        for (long v = -500; v <= 500; v++) keys.add(v);
        while (keys.size() < KEYS_PER_FILE) {
            switch (rnd.nextInt(4)) {
                case 0 -> keys.add((long) rnd.nextInt());
                case 1 -> keys.add(((long) rnd.nextInt() << 32) | (rnd.nextInt() & 0xFFFFL));
                default -> keys.add(rnd.nextLong());
            }
        }
        List<LongRow> rows = new ArrayList<>();
        for (long v : keys) rows.add(new LongRow(v));
        return rows;
    }

    /** A code point from a mix of ASCII, 2-byte, 3-byte (no surrogates) and 4-byte UTF-8 ranges. */
    static int codePoint(Random rnd) {
        int r = rnd.nextInt(100);
        if (r < 40) return 0x20 + rnd.nextInt(0x5F);
        if (r < 45) return rnd.nextInt(0x20);
        if (r < 60) return 0x80 + rnd.nextInt(0x800 - 0x80);
        if (r < 80) {
            int cp;
            do cp = 0x800 + rnd.nextInt(0x10000 - 0x800); while (cp >= 0xD800 && cp <= 0xDFFF);
            return cp;
        }
        if (r < 90) return 0x1F300 + rnd.nextInt(0x300); // emoji
        return 0x10000 + rnd.nextInt(0x110000 - 0x10000);
    }

    static List<StrRow> strKeys(Random rnd) {
        Set<String> keys = new LinkedHashSet<>(List.of("", "a", "A", "hello", "Flink", "key-1",
                "ü", "日本語", "😀", "a😀b", "\u0080", "\u07FF", "\u0800", "\uFFFF",
                new String(Character.toChars(0x10000)), new String(Character.toChars(0x10FFFF)),
                "x".repeat(1000), "😀".repeat(300)));
        for (int i = 0; i < 1000; i++) keys.add("key-" + i);
        while (keys.size() < KEYS_PER_FILE) {
            int len = rnd.nextInt(20) == 0 ? rnd.nextInt(150) : rnd.nextInt(16);
            StringBuilder sb = new StringBuilder();
            for (int i = 0; i < len; i++) sb.appendCodePoint(codePoint(rnd));
            keys.add(sb.toString());
        }
        List<StrRow> rows = new ArrayList<>();
        for (String s : keys) rows.add(new StrRow(s));
        return rows;
    }

    static List<BytesRow> bytesKeys(Random rnd) {
        List<BytesRow> rows = new ArrayList<>();
        for (byte[] b : new byte[][] {{}, {0}, {-1}, {127}, {-128}, {1, 2, 3}}) rows.add(new BytesRow(b));
        while (rows.size() < BYTE_KEYS_PER_FILE) {
            byte[] b = new byte[rnd.nextInt(20) == 0 ? rnd.nextInt(200) : rnd.nextInt(20)];
            rnd.nextBytes(b);
            rows.add(new BytesRow(b));
        }
        return rows;
    }

    /** Byte strings mixing valid UTF-8 with every kind of malformed sequence. */
    static List<Utf8Row> utf8Keys(Random rnd) {
        byte[][] bad = {
            {(byte) 0x80}, {(byte) 0xBF}, {(byte) 0xC0, (byte) 0x80}, {(byte) 0xC1, (byte) 0xBF},
            {(byte) 0xE0, (byte) 0x80, (byte) 0x80}, {(byte) 0xE0, (byte) 0xA0},
            {(byte) 0xED, (byte) 0xA0, (byte) 0x80}, {(byte) 0xED, (byte) 0xBF, (byte) 0xBF},
            {(byte) 0xF0, (byte) 0x80, (byte) 0x80, (byte) 0x80}, {(byte) 0xF0, (byte) 0x90},
            {(byte) 0xF0, (byte) 0x90, (byte) 0x80}, {(byte) 0xF4, (byte) 0x90, (byte) 0x80, (byte) 0x80},
            {(byte) 0xF5}, {(byte) 0xF8, (byte) 0x88, (byte) 0x80, (byte) 0x80, (byte) 0x80},
            {(byte) 0xFE}, {(byte) 0xFF}, {(byte) 0xE2, (byte) 0x82}, {(byte) 0xC3},
        };
        List<Utf8Row> rows = new ArrayList<>();
        for (byte[] b : bad) rows.add(new Utf8Row(b));
        while (rows.size() < BYTE_KEYS_PER_FILE) {
            java.io.ByteArrayOutputStream out = new java.io.ByteArrayOutputStream();
            int pieces = rnd.nextInt(8);
            for (int i = 0; i < pieces; i++) {
                int r = rnd.nextInt(10);
                if (r < 4) {
                    out.writeBytes(new String(Character.toChars(codePoint(rnd))).getBytes(StandardCharsets.UTF_8));
                } else if (r < 6) {
                    out.writeBytes(bad[rnd.nextInt(bad.length)]);
                } else if (r < 8) { // a valid multi-byte character cut short
                    int cp;
                    do cp = 0x800 + rnd.nextInt(0x110000 - 0x800); while (cp >= 0xD800 && cp <= 0xDFFF);
                    byte[] c = new String(Character.toChars(cp)).getBytes(StandardCharsets.UTF_8);
                    out.write(c, 0, 1 + rnd.nextInt(c.length - 1));
                } else {
                    out.write(rnd.nextInt(256));
                }
            }
            rows.add(new Utf8Row(out.toByteArray()));
        }
        return rows;
    }

    public static void main(String[] args) throws IOException {
        Path dir = Paths.get(args.length > 0 ? args[0] : "tests/golden/keygroups");
        Files.createDirectories(dir);
        Random rnd = new Random(SEED);
        write(dir, "int32", int32Keys(rnd));
        write(dir, "int64", int64Keys(rnd));
        write(dir, "str", strKeys(rnd));
        write(dir, "bytes", bytesKeys(rnd));
        write(dir, "utf8_malformed", utf8Keys(rnd));
    }
}
