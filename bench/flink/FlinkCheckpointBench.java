// The reference job of `spillover bench`, run on Apache Flink 2.3 (local
// MiniCluster), to compare checkpoint durations on the same machine and job
// shape. Compiled and run by bench/flink/run.py; see docs/benchmarks.md.
//
//   unthrottled source: (long key of 10,000, 100-byte payload)
//   -> keyBy(key) -> keyed count (ValueState<Long>, emits (key, count))
//   -> rebalance() -> sink paced to N records/s per subtask (sleeps)
//
// Parallelism 2, exactly-once checkpoints every second, 32 KiB network
// buffers, filesystem checkpoint storage in a temporary directory. After the
// warm-up and the measured window, the per-checkpoint statistics are read from
// the MiniCluster's REST API (bound to 127.0.0.1) and one JSON line is printed,
// prefixed with "FLINK_BENCH_RESULT ". With --stops N, the job is stopped with
// a savepoint after the warm-up instead, N times (see stopRounds). With
// --recovery N, the keyed count fails once after the warm-up and the job
// restarts from its latest checkpoint, N times (see recoveryRounds). With
// --rescale N, the job is stopped with a savepoint at parallelism 2 and
// restored from it at 3, N times (see rescaleRounds).

import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Comparator;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;

import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.connector.sink2.Sink;
import org.apache.flink.api.connector.sink2.SinkWriter;
import org.apache.flink.api.connector.sink2.WriterInitContext;
import org.apache.flink.api.connector.source.util.ratelimit.RateLimiterStrategy;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.connector.datagen.source.DataGeneratorSource;
import org.apache.flink.connector.datagen.source.GeneratorFunction;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.runtime.minicluster.MiniCluster;
import org.apache.flink.runtime.minicluster.MiniClusterConfiguration;
import org.apache.flink.runtime.util.EnvironmentInformation;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.util.Collector;

public final class FlinkCheckpointBench {

    static final int KEYS = 10_000;
    static final int PAYLOAD_BYTES = 100;
    static final String RESULT_PREFIX = "FLINK_BENCH_RESULT ";

    // The MiniCluster runs in this JVM and the job's classes come from the
    // application class path, so these counters are shared with the tasks.
    static final LongAdder SOURCE_RECORDS = new LongAdder();
    static final LongAdder SINK_RECORDS = new LongAdder();

    // Recovery and rescale rounds. ARMED: the keyed count's subtask 0 fails on its
    // next record, once (FIRED), in its first attempt; FAILED_AT is then.
    // Sink writers of a later attempt (recovery) or at the new parallelism
    // (rescale) count in LATER_RECORDS and stamp LATER_FIRST at their first record.
    static volatile boolean ARMED = false;
    // The round under way: tasks of an earlier round's job, still winding down, do not count.
    static volatile int ROUND = 0;
    static final AtomicBoolean FIRED = new AtomicBoolean();
    static volatile long FAILED_AT = 0;
    static volatile int LATER_PARALLELISM = -1; // rescale: writers at this parallelism
    static final LongAdder LATER_RECORDS = new LongAdder();
    static final AtomicLong LATER_FIRST = new AtomicLong(0);
    // When the first and the last keyed-count or sink task of the later attempt opened
    // (state restored; REST's job status is cached for web.refresh-interval, too coarse).
    static final AtomicLong LATER_OPEN_FIRST = new AtomicLong(0);
    static final AtomicLong LATER_OPEN_LAST = new AtomicLong(0);

    static void laterOpened() {
        long now = System.nanoTime();
        LATER_OPEN_FIRST.compareAndSet(0, now);
        LATER_OPEN_LAST.accumulateAndGet(now, Math::max);
    }

    static void resetRound() {
        ROUND++;
        ARMED = false;
        FIRED.set(false);
        FAILED_AT = 0;
        LATER_PARALLELISM = -1;
        LATER_RECORDS.reset();
        LATER_FIRST.set(0);
        LATER_OPEN_FIRST.set(0);
        LATER_OPEN_LAST.set(0);
    }

    // ------------------------------------------------------------------ job

    /** Record i: a key among KEYS (spread by a 64-bit mix of i), a fixed payload. */
    static final class RecordGenerator implements GeneratorFunction<Long, Tuple2<Long, byte[]>> {
        private static final long serialVersionUID = 1L;
        private transient byte[] payload;

        @Override
        public void open(org.apache.flink.api.connector.source.SourceReaderContext ctx) {
            payload = new byte[PAYLOAD_BYTES];
            for (int i = 0; i < PAYLOAD_BYTES; i++) {
                payload[i] = (byte) ('a' + i % 26);
            }
        }

        @Override
        public Tuple2<Long, byte[]> map(Long index) {
            long z = index * 0x9E3779B97F4A7C15L; // splitmix64 finaliser
            z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9L;
            z = (z ^ (z >>> 27)) * 0x94D049BB133111EBL;
            z = z ^ (z >>> 31);
            SOURCE_RECORDS.increment();
            return Tuple2.of(Math.floorMod(z, (long) KEYS), payload);
        }
    }

    /** count per key in ValueState<Long>; emits (key, count) for every record. */
    static final class KeyedCount
            extends KeyedProcessFunction<Long, Tuple2<Long, byte[]>, Tuple2<Long, Long>> {
        private static final long serialVersionUID = 1L;
        private transient ValueState<Long> count;
        private transient boolean mayFail; // subtask 0 in its first attempt

        @Override
        public void open(OpenContext ctx) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            var info = getRuntimeContext().getTaskInfo();
            mayFail = info.getIndexOfThisSubtask() == 0 && info.getAttemptNumber() == 0;
            if (info.getAttemptNumber() > 0 || info.getNumberOfParallelSubtasks() == LATER_PARALLELISM) {
                laterOpened();
            }
        }

        @Override
        public void processElement(Tuple2<Long, byte[]> rec, Context ctx,
                                   Collector<Tuple2<Long, Long>> out) throws Exception {
            if (mayFail && ARMED && FIRED.compareAndSet(false, true)) {
                FAILED_AT = System.nanoTime();
                throw new RuntimeException("induced failure in keyed-count#0 (recovery benchmark)");
            }
            Long c = count.value();
            long n = (c == null ? 0L : c) + 1L;
            count.update(n);
            out.collect(Tuple2.of(rec.f0, n));
        }
    }

    /**
     * A sink that paces itself to {@code ratePerSubtask} records/s by sleeping
     * on its task thread. Lost time (e.g. while blocked by an alignment) is
     * caught up by at most {@code maxBurstMs} worth of records, like a token
     * bucket, so the sink never runs far above its rate.
     */
    static final class PacedSink implements Sink<Tuple2<Long, Long>> {
        private static final long serialVersionUID = 1L;
        private final double ratePerSubtask;
        private final long maxBurstMs;

        PacedSink(double ratePerSubtask, long maxBurstMs) {
            this.ratePerSubtask = ratePerSubtask;
            this.maxBurstMs = maxBurstMs;
        }

        @Override
        public SinkWriter<Tuple2<Long, Long>> createWriter(WriterInitContext context) {
            var info = context.getTaskInfo();
            boolean later = info.getAttemptNumber() > 0
                    || info.getNumberOfParallelSubtasks() == LATER_PARALLELISM;
            if (later) {
                laterOpened();
            }
            return new PacedWriter(ratePerSubtask, maxBurstMs, later);
        }
    }

    static final class PacedWriter implements SinkWriter<Tuple2<Long, Long>> {
        private final long nanosPerRecord;
        private final long maxBurstNanos;
        private final boolean later; // a restarted attempt, or at the new parallelism
        private final int round = ROUND;
        private long next = Long.MIN_VALUE; // time the next record is due

        PacedWriter(double rate, long maxBurstMs, boolean later) {
            this.nanosPerRecord = Math.max(1L, Math.round(1e9 / rate));
            this.maxBurstNanos = TimeUnit.MILLISECONDS.toNanos(maxBurstMs);
            this.later = later;
        }

        @Override
        public void write(Tuple2<Long, Long> element, Context context) throws InterruptedException {
            long now = System.nanoTime();
            if (next == Long.MIN_VALUE || now - next > maxBurstNanos) {
                next = now - (next == Long.MIN_VALUE ? 0 : maxBurstNanos);
            }
            long ahead = next - now;
            if (ahead >= 1_000_000L) { // sleep in steps of at least 1 ms
                Thread.sleep(ahead / 1_000_000L, (int) (ahead % 1_000_000L));
            }
            next += nanosPerRecord;
            SINK_RECORDS.increment();
            if (later && round == ROUND) {
                LATER_FIRST.compareAndSet(0, System.nanoTime());
                LATER_RECORDS.increment();
            }
        }

        @Override
        public void flush(boolean endOfInput) {}

        @Override
        public void close() {}
    }

    // ------------------------------------------------------------- policies

    static Map<String, String> policyConfig(String policy) {
        Map<String, String> m = new LinkedHashMap<>();
        switch (policy) {
            case "aligned":
                m.put("execution.checkpointing.unaligned.enabled", "false");
                break;
            case "unaligned":
                m.put("execution.checkpointing.unaligned.enabled", "true");
                m.put("execution.checkpointing.aligned-checkpoint-timeout", "0 ms");
                break;
            case "aligned-timeout":
                m.put("execution.checkpointing.unaligned.enabled", "true");
                m.put("execution.checkpointing.aligned-checkpoint-timeout", "100 ms");
                break;
            case "none":  // no checkpoints: the job's bare throughput
                break;
            case "debloat":
                m.put("execution.checkpointing.unaligned.enabled", "false");
                m.put("taskmanager.network.memory.buffer-debloat.enabled", "true");
                m.put("taskmanager.network.memory.buffer-debloat.target", "300 ms");
                break;
            default:
                throw new IllegalArgumentException(
                        "unknown policy " + policy + " (none, aligned, unaligned, aligned-timeout, debloat)");
        }
        return m;
    }

    // ----------------------------------------------------------------- main

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = parseArgs(argv);
        String policy = args.getOrDefault("policy", "aligned");
        double duration = Double.parseDouble(args.getOrDefault("duration", "30"));
        double warmup = Double.parseDouble(args.getOrDefault("warmup", "10"));
        double sinkRate = Double.parseDouble(args.getOrDefault("sink-rate", "5000"));
        int parallelism = Integer.parseInt(args.getOrDefault("parallelism", "2"));
        long intervalMs = Long.parseLong(args.getOrDefault("interval-ms", "1000"));
        Path ckptDir = args.containsKey("checkpoint-dir")
                ? Path.of(args.get("checkpoint-dir"))
                : Files.createTempDirectory("flink-ckpt-");
        Files.createDirectories(ckptDir);
        String rawOut = args.get("raw-out");

        int restPort = freeLocalPort();
        Map<String, String> conf = new LinkedHashMap<>();
        if (!policy.equals("none")) {
            conf.put("execution.checkpointing.interval", intervalMs + " ms");
        }
        conf.put("execution.checkpointing.mode", "EXACTLY_ONCE");
        conf.put("execution.checkpointing.max-concurrent-checkpoints", "1");
        conf.put("execution.checkpointing.min-pause", "0 ms");
        conf.put("execution.checkpointing.timeout", "10 min");
        conf.put("execution.checkpointing.storage", "filesystem");
        conf.put("execution.checkpointing.dir", ckptDir.toUri().toString());
        conf.put("execution.checkpointing.num-retained", "1");
        conf.put("state.backend.type", "hashmap");
        conf.put("taskmanager.memory.segment-size", args.getOrDefault("segment-size", "32kb"));
        conf.put("rest.bind-address", "127.0.0.1");
        conf.put("rest.address", "127.0.0.1");
        conf.put("rest.bind-port", Integer.toString(restPort));
        conf.put("rest.port", Integer.toString(restPort));
        conf.put("web.checkpoints.history", "10000");
        conf.put("web.refresh-interval", "500");
        conf.putAll(policyConfig(policy));

        int recoveries = Integer.parseInt(args.getOrDefault("recovery", "0"));
        if (recoveries > 0) {
            double after = Double.parseDouble(args.getOrDefault("after", "8"));
            conf.put("restart-strategy.type", "fixed-delay");
            conf.put("restart-strategy.fixed-delay.attempts", "1");
            conf.put("restart-strategy.fixed-delay.delay",
                    args.getOrDefault("restart-delay-ms", "0") + " ms");
            recoveryRounds(conf, policy, parallelism, sinkRate, warmup, after, recoveries);
            deleteTree(ckptDir);
            System.exit(0);
        }
        int rescales = Integer.parseInt(args.getOrDefault("rescale", "0"));
        if (rescales > 0) {
            int to = Integer.parseInt(args.getOrDefault("to-parallelism", "3"));
            rescaleRounds(conf, policy, parallelism, to, sinkRate, warmup, rescales);
            deleteTree(ckptDir);
            System.exit(0);
        }
        int stops = Integer.parseInt(args.getOrDefault("stops", "0"));
        if (stops > 0) {
            stopRounds(conf, policy, parallelism, sinkRate, warmup, stops, ckptDir);
            deleteTree(ckptDir);
            System.exit(0);
        }
        StreamExecutionEnvironment env = buildJob(conf, parallelism, sinkRate);

        log("policy %s: starting (rest port %d, checkpoints in %s)", policy, restPort, ckptDir);
        JobClient job = env.executeAsync("spillover-reference-" + policy);
        String jobId = job.getJobID().toHexString();
        String base = "http://127.0.0.1:" + restPort;
        HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
        ObjectMapper json = new ObjectMapper();

        // Wait until every task runs, then warm up.
        waitRunning(http, json, base, jobId, 120_000);
        log("policy %s: job %s running; warm-up %.0f s", policy, jobId, warmup);
        Thread.sleep((long) (warmup * 1000));

        var os = (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        long wallStartMs = System.currentTimeMillis();
        long t0 = System.nanoTime();
        long cpu0 = os.getProcessCpuTime();
        long sink0 = SINK_RECORDS.sum();
        long src0 = SOURCE_RECORDS.sum();
        log("policy %s: measuring %.0f s", policy, duration);
        Thread.sleep((long) (duration * 1000));
        long t1 = System.nanoTime();
        long cpu1 = os.getProcessCpuTime();
        long sink1 = SINK_RECORDS.sum();
        long src1 = SOURCE_RECORDS.sum();
        long wallEndMs = System.currentTimeMillis();
        double elapsed = (t1 - t0) / 1e9;

        // Let a checkpoint in flight at the end of the window complete, then read stats.
        Thread.sleep(1500);
        // Without checkpointing the REST API has no checkpoint statistics to give.
        JsonNode overview = policy.equals("none")
                ? json.createObjectNode()
                : getJson(http, json, base + "/jobs/" + jobId + "/checkpoints");
        JsonNode jobInfo = getJson(http, json, base + "/jobs/" + jobId);
        String jobState = jobInfo.path("state").asText();

        List<String> vertexIds = new ArrayList<>();
        Map<String, String> vertexNames = new HashMap<>();
        for (JsonNode v : jobInfo.path("vertices")) {
            vertexIds.add(v.path("id").asText());
            vertexNames.put(v.path("id").asText(), v.path("name").asText());
        }

        List<Map<String, Object>> ckpts = new ArrayList<>();
        int completed = 0, failed = 0, inProgress = 0;
        List<Double> durations = new ArrayList<>();
        List<Double> persisted = new ArrayList<>();
        List<Double> processed = new ArrayList<>();
        List<Double> stateSize = new ArrayList<>();
        List<Double> startDelays = new ArrayList<>();
        List<Double> alignments = new ArrayList<>();
        int unalignedCount = 0;
        List<JsonNode> history = new ArrayList<>();
        overview.path("history").forEach(history::add);
        history.sort(Comparator.comparingLong(h -> h.path("id").asLong()));
        for (JsonNode h : history) {
            long trig = h.path("trigger_timestamp").asLong();
            if (trig < wallStartMs || trig >= wallEndMs) {
                continue;
            }
            String status = h.path("status").asText();
            if ("COMPLETED".equals(status)) {
                completed++;
            } else if ("FAILED".equals(status)) {
                failed++;
                continue;
            } else {
                inProgress++;
                continue;
            }
            long id = h.path("id").asLong();
            double d = h.path("end_to_end_duration").asDouble();
            String type = h.path("checkpoint_type").asText();
            boolean unaligned = h.path("unaligned").asBoolean(type.contains("UNALIGNED"));
            if (unaligned) {
                unalignedCount++;
            }
            // Per subtask: the start delay (trigger -> first barrier) and the
            // alignment duration; the slowest subtask of any vertex counts.
            double maxDelay = 0, maxAlign = 0;
            for (String vid : vertexIds) {
                JsonNode st = getJson(http, json,
                        base + "/jobs/" + jobId + "/checkpoints/details/" + id + "/subtasks/" + vid);
                for (JsonNode s : st.path("subtasks")) {
                    maxDelay = Math.max(maxDelay, s.path("start_delay").asDouble());
                    maxAlign = Math.max(maxAlign, s.path("alignment").path("duration").asDouble());
                }
            }
            durations.add(d);
            persisted.add(h.path("persisted_data").asDouble());
            processed.add(h.path("processed_data").asDouble());
            stateSize.add(h.path("state_size").asDouble());
            startDelays.add(maxDelay);
            alignments.add(maxAlign);
            Map<String, Object> c = new LinkedHashMap<>();
            c.put("id", id);
            c.put("type", type);
            c.put("duration_ms", d);
            c.put("persisted_bytes", h.path("persisted_data").asLong());
            c.put("processed_bytes", h.path("processed_data").asLong());
            c.put("state_bytes", h.path("state_size").asLong());
            c.put("max_start_delay_ms", maxDelay);
            c.put("max_alignment_ms", maxAlign);
            ckpts.add(c);
        }
        if (rawOut != null) {
            Map<String, Object> raw = new LinkedHashMap<>();
            raw.put("checkpoints", overview);
            raw.put("job", jobInfo);
            Files.writeString(Path.of(rawOut), json.writerWithDefaultPrettyPrinter().writeValueAsString(raw));
        }

        Map<String, Object> r = result(null, policy, conf);
        r.put("parallelism", parallelism);
        r.put("keys", KEYS);
        r.put("payload_bytes", PAYLOAD_BYTES);
        r.put("sink_rate_per_subtask", sinkRate);
        r.put("warmup_s", warmup);
        r.put("duration_s", round(elapsed, 3));
        r.put("job_state_at_end", jobState);
        r.put("checkpoints_completed", completed);
        r.put("checkpoints_failed", failed);
        r.put("checkpoints_in_progress", inProgress);
        r.put("checkpoints_unaligned", unalignedCount);
        r.put("checkpoint_ms_median", pct(durations, 50));
        r.put("checkpoint_ms_p90", pct(durations, 90));
        r.put("checkpoint_ms_max", durations.isEmpty() ? null : Collections.max(durations));
        r.put("checkpoint_ms_min", durations.isEmpty() ? null : Collections.min(durations));
        r.put("start_delay_ms_median", pct(startDelays, 50));
        r.put("alignment_ms_median", pct(alignments, 50));
        r.put("persisted_bytes_median", pct(persisted, 50));
        r.put("persisted_bytes_max", persisted.isEmpty() ? null : Collections.max(persisted));
        r.put("processed_bytes_median", pct(processed, 50));
        r.put("state_bytes_median", pct(stateSize, 50));
        r.put("sink_records_per_s", round((sink1 - sink0) / elapsed, 1));
        r.put("sink_records_per_s_per_subtask", round((sink1 - sink0) / elapsed / parallelism, 1));
        r.put("source_records_per_s", round((src1 - src0) / elapsed, 1));
        r.put("cpu_cores_used", round((cpu1 - cpu0) / 1e9 / elapsed, 2));
        r.put("vertices", vertexNames.values());
        r.put("checkpoints", ckpts);
        emit(json, r);

        try {
            job.cancel().get(60, TimeUnit.SECONDS);
        } catch (Exception e) {
            log("cancel: %s", e);
        }
        deleteTree(ckptDir);
        System.exit(0);
    }

    // ------------------------------------------------------- stop mode

    /** The reference job on a local MiniCluster configured by {@code conf}. */
    static StreamExecutionEnvironment buildJob(Map<String, String> conf, int parallelism, double sinkRate) {
        StreamExecutionEnvironment env =
                StreamExecutionEnvironment.createLocalEnvironment(parallelism, Configuration.fromMap(conf));
        return addPipeline(env, sinkRate);
    }

    /** The reference job's operators, added to {@code env}. */
    static StreamExecutionEnvironment addPipeline(StreamExecutionEnvironment env, double sinkRate) {
        TypeInformation<Tuple2<Long, byte[]>> recType =
                Types.TUPLE(Types.LONG, Types.PRIMITIVE_ARRAY(Types.BYTE));
        DataGeneratorSource<Tuple2<Long, byte[]>> source = new DataGeneratorSource<>(
                new RecordGenerator(), Long.MAX_VALUE, RateLimiterStrategy.noOp(), recType);
        env.fromSource(source, WatermarkStrategy.noWatermarks(), "source", recType)
                .keyBy(t -> t.f0, Types.LONG)
                .process(new KeyedCount())
                .returns(Types.TUPLE(Types.LONG, Types.LONG))
                .name("keyed-count")
                .rebalance()
                .sinkTo(new PacedSink(sinkRate, 50))
                .name("paced-sink");
        return env;
    }

    /**
     * Stop-with-savepoint under backpressure, {@code stops} times in this JVM (a new
     * job and MiniCluster each time): after the warm-up and at least two completed
     * checkpoints, {@code JobClient#stopWithSavepoint(false, dir, CANONICAL)} (no
     * drain; in Flink 2.x a savepoint is aligned whatever the checkpointing mode),
     * timed from the request to the savepoint's completion (the savepoint's
     * trigger time plus its end-to-end duration, read from the REST API while the
     * stop runs; else the time its _metadata file was written) and to the future's
     * completion (savepoint done and the job ended). Prints one result line.
     */
    static void stopRounds(Map<String, String> baseConf, String policy, int parallelism,
                           double sinkRate, double warmup, int stops, Path ckptDir) throws Exception {
        ObjectMapper json = new ObjectMapper();
        HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
        List<Map<String, Object>> rounds = new ArrayList<>();
        List<Double> complete = new ArrayList<>();
        List<Double> returned = new ArrayList<>();
        for (int round = 0; round < stops; round++) {
            int port = freeLocalPort();
            Map<String, String> conf = withRestPort(baseConf, port);
            Path spDir = Files.createTempDirectory("flink-savepoint-");
            StreamExecutionEnvironment env = buildJob(conf, parallelism, sinkRate);
            JobClient job = env.executeAsync("spillover-reference-stop-" + policy + "-" + round);
            String jobId = job.getJobID().toHexString();
            String base = "http://127.0.0.1:" + port;
            waitRunning(http, json, base, jobId, 120_000);
            long runningAt = System.nanoTime();
            Thread.sleep((long) (warmup * 1000));
            long before = 0;
            while (true) {
                before = getJson(http, json, base + "/jobs/" + jobId + "/checkpoints")
                        .path("counts").path("completed").asLong();
                if (before >= 2 || System.nanoTime() - runningAt > 120_000_000_000L) {
                    break;
                }
                Thread.sleep(50);
            }
            double waited = (System.nanoTime() - runningAt) / 1e9;
            long reqWall = System.currentTimeMillis();
            long req = System.nanoTime();
            var future = job.stopWithSavepoint(false, spDir.toUri().toString(),
                    org.apache.flink.core.execution.SavepointFormatType.CANONICAL);
            // The savepoint's statistics, read while the job still answers.
            JsonNode seen = null;
            while (!future.isDone()) {
                try {
                    JsonNode hist = getJson(http, json, base + "/jobs/" + jobId + "/checkpoints").path("history");
                    for (JsonNode h : hist) {
                        if (h.path("is_savepoint").asBoolean(false) && h.path("trigger_timestamp").asLong() >= reqWall - 5) {
                            seen = h;
                        }
                    }
                } catch (Exception e) {
                    // the job or its cluster is going away
                }
                Thread.sleep(10);
            }
            String path = future.get(10, TimeUnit.MINUTES);
            double returnedMs = (System.nanoTime() - req) / 1e6;
            Path spPath = Path.of(URI.create(path.startsWith("file:") ? path : "file://" + path));
            long bytes = 0, files = 0;
            long metaMtime = 0;
            try (var walk = Files.walk(spPath)) {
                for (Path f : (Iterable<Path>) walk.filter(Files::isRegularFile)::iterator) {
                    bytes += Files.size(f);
                    files++;
                    if (f.getFileName().toString().equals("_metadata")) {
                        metaMtime = Files.getLastModifiedTime(f).toMillis();
                    }
                }
            }
            Map<String, Object> r = new LinkedHashMap<>();
            r.put("round", round);
            r.put("waited_s", round(waited, 3));
            r.put("checkpoints_before", before);
            Double completeMs = null;
            if (seen != null && "COMPLETED".equals(seen.path("status").asText())) {
                long trig = seen.path("trigger_timestamp").asLong();
                r.put("trigger_ms", (double) (trig - reqWall));
                completeMs = (double) (trig + seen.path("end_to_end_duration").asLong() - reqWall);
                r.put("complete_from", "rest");
                r.put("persisted_bytes", seen.path("persisted_data").asLong());
                r.put("checkpoint_type", seen.path("checkpoint_type").asText());
            } else if (metaMtime > 0) {
                completeMs = (double) (metaMtime - reqWall);
                r.put("complete_from", "_metadata mtime");
            }
            r.put("complete_ms", completeMs);
            r.put("returned_ms", round(returnedMs, 1));
            r.put("savepoint_bytes", bytes);
            r.put("savepoint_files", files);
            rounds.add(r);
            if (completeMs != null) {
                complete.add(completeMs);
            }
            returned.add(returnedMs);
            log("stop %d: savepoint complete %s ms, returned %.1f ms, %d B in %d files",
                    round, completeMs, returnedMs, bytes, files);
            deleteTree(spDir);
        }
        Map<String, Object> r = result("stop-with-savepoint", policy, baseConf);
        r.put("parallelism", parallelism);
        r.put("sink_rate_per_subtask", sinkRate);
        r.put("warmup_s", warmup);
        r.put("stops", rounds);
        spread(r, "complete_ms", complete);
        spread(r, "returned_ms", returned);
        emit(json, r);
    }

    // --------------------------------------------------- recovery mode

    /**
     * Recovery under backpressure, {@code rounds} times (a new job and MiniCluster
     * each time): after the warm-up and at least two completed checkpoints, the sink's
     * steady rate is measured over two seconds, then the keyed count's subtask 0 throws
     * on its next record (once). Flink restarts the job from its latest (unaligned)
     * checkpoint with the configured restart strategy. Timed from the throw: the first
     * record a restarted sink writer takes, and the start of the first 500 ms window in
     * which the restarted sinks take at least 90 % of the steady rate; the in-flight
     * bytes replayed are the restored checkpoint's {@code persisted_data} (REST).
     * Prints one result line.
     */
    static void recoveryRounds(Map<String, String> baseConf, String policy, int parallelism,
                               double sinkRate, double warmup, double after, int rounds) throws Exception {
        ObjectMapper json = new ObjectMapper();
        HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
        List<Map<String, Object>> out = new ArrayList<>();
        List<Double> firsts = new ArrayList<>(), ninety = new ArrayList<>(), running = new ArrayList<>();
        List<Double> replayed = new ArrayList<>();
        for (int round = 0; round < rounds; round++) {
            resetRound();
            int port = freeLocalPort();
            Map<String, String> conf = withRestPort(baseConf, port);
            StreamExecutionEnvironment env = buildJob(conf, parallelism, sinkRate);
            JobClient job = env.executeAsync("spillover-reference-recovery-" + policy + "-" + round);
            String jobId = job.getJobID().toHexString();
            String base = "http://127.0.0.1:" + port;
            waitRunning(http, json, base, jobId, 120_000);
            long runningAt = System.nanoTime();
            Thread.sleep((long) (warmup * 1000));
            waitCheckpoints(http, json, base, jobId, 2, runningAt);
            long s0 = SINK_RECORDS.sum();
            long t0 = System.nanoTime();
            Thread.sleep(2000);
            double steady = (SINK_RECORDS.sum() - s0) / ((System.nanoTime() - t0) / 1e9);
            ARMED = true;
            long armedAt = System.nanoTime();
            while (FAILED_AT == 0 && System.nanoTime() - armedAt < 60_000_000_000L) {
                Thread.sleep(0, 200_000);
            }
            long failed = FAILED_AT;
            if (failed == 0) {
                throw new IllegalStateException("the induced failure did not fire within 60 s");
            }
            // The restarted sinks' records, every ~5 ms.
            List<long[]> series = new ArrayList<>();
            while (System.nanoTime() - failed < (long) (after * 1e9)) {
                series.add(new long[] {System.nanoTime() - failed, LATER_RECORDS.sum()});
                Thread.sleep(5);
            }
            Double openedMs = LATER_OPEN_FIRST.get() == 0 ? null : round((LATER_OPEN_FIRST.get() - failed) / 1e6, 1);
            Double runningMs = LATER_OPEN_LAST.get() == 0 ? null : round((LATER_OPEN_LAST.get() - failed) / 1e6, 1);
            long first = LATER_FIRST.get();
            Double firstMs = first == 0 ? null : round((first - failed) / 1e6, 1);
            Double ninetyMs = windowStartMs(series, 0.9 * steady, 500);
            if (ninetyMs != null && firstMs != null) {
                ninetyMs = Math.max(ninetyMs, firstMs); // not before the first record
            }
            JsonNode ck = getJson(http, json, base + "/jobs/" + jobId + "/checkpoints");
            long restoredId = ck.path("latest").path("restored").path("id").asLong(-1);
            Long persisted = null;
            for (JsonNode h : ck.path("history")) {
                if (h.path("id").asLong() == restoredId) {
                    persisted = h.path("persisted_data").asLong();
                }
            }
            if (persisted == null && restoredId >= 0) {
                persisted = getJson(http, json, base + "/jobs/" + jobId + "/checkpoints/details/" + restoredId)
                        .path("persisted_data").asLong();
            }
            Map<String, Object> r = new LinkedHashMap<>();
            r.put("round", round);
            r.put("steady_records_per_s", round(steady, 1));
            r.put("restored_checkpoint", restoredId);
            r.put("first_task_opened_ms", openedMs);
            r.put("running_again_ms", runningMs);
            r.put("first_record_ms", firstMs);
            r.put("ninety_percent_ms", ninetyMs);
            r.put("replayed_bytes", persisted);
            List<List<Double>> pts = new ArrayList<>();
            for (int i = 0; i < series.size(); i += 4) { // every ~20 ms is enough for a plot
                pts.add(List.of(round(series.get(i)[0] / 1e6, 1), (double) series.get(i)[1]));
            }
            r.put("series_ms_records", pts);
            out.add(r);
            if (firstMs != null) {
                firsts.add(firstMs);
            }
            if (ninetyMs != null) {
                ninety.add(ninetyMs);
            }
            if (runningMs != null) {
                running.add(runningMs);
            }
            if (persisted != null) {
                replayed.add((double) persisted);
            }
            log("recovery %d: tasks opened %s-%s ms, first record %s ms, 90%% %s ms, replayed %s B",
                    round, openedMs, runningMs, firstMs, ninetyMs, persisted);
            try {
                job.cancel().get(60, TimeUnit.SECONDS);
            } catch (Exception e) {
                log("cancel: %s", e);
            }
        }
        Map<String, Object> r = result("recovery", policy, baseConf);
        r.put("parallelism", parallelism);
        r.put("sink_rate_per_subtask", sinkRate);
        r.put("warmup_s", warmup);
        r.put("rounds", out);
        spread(r, "running_again_ms", running);
        spread(r, "first_record_ms", firsts);
        spread(r, "ninety_percent_ms", ninety);
        spread(r, "replayed_bytes", replayed);
        emit(json, r);
    }

    /**
     * The start (ms after the failure) of the first window of {@code windowMs} in
     * which the records of {@code series} ({nanos since the failure, records}) grow
     * at {@code rate} per second or more; null if none does.
     */
    static Double windowStartMs(List<long[]> series, double rate, long windowMs) {
        long w = windowMs * 1_000_000L;
        int j = 0;
        for (int i = 0; i < series.size(); i++) {
            long[] a = series.get(i);
            while (j < series.size() && series.get(j)[0] < a[0] + w) {
                j++;
            }
            if (j >= series.size()) {
                return null;
            }
            long[] b = series.get(j);
            if ((b[1] - a[1]) / ((b[0] - a[0]) / 1e9) >= rate) {
                return round(a[0] / 1e6, 1);
            }
        }
        return null;
    }

    static long waitCheckpoints(HttpClient http, ObjectMapper json, String base, String jobId,
                                long atLeast, long since) throws Exception {
        while (true) {
            long n = getJson(http, json, base + "/jobs/" + jobId + "/checkpoints")
                    .path("counts").path("completed").asLong();
            if (n >= atLeast || System.nanoTime() - since > 120_000_000_000L) {
                return n;
            }
            Thread.sleep(50);
        }
    }

    // ---------------------------------------------------- rescale mode

    /**
     * Flink's stop-and-restore at a new parallelism, {@code rounds} times, each on a
     * MiniCluster of its own that stays up for both jobs (as a session cluster would):
     * the job at {@code from} runs its warm-up and two checkpoints, is stopped with a
     * savepoint (no drain), and is submitted again at {@code to} with
     * {@code execution.state-recovery.path} set to the savepoint. Timed from the stop
     * request: the savepoint returned, the new job running, and its first sink record.
     * Prints one result line.
     */
    static void rescaleRounds(Map<String, String> baseConf, String policy, int from, int to,
                              double sinkRate, double warmup, int rounds) throws Exception {
        ObjectMapper json = new ObjectMapper();
        HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
        List<Map<String, Object>> out = new ArrayList<>();
        List<Double> saved = new ArrayList<>(), running = new ArrayList<>(), firsts = new ArrayList<>();
        for (int round = 0; round < rounds; round++) {
            resetRound();
            int port = freeLocalPort();
            Map<String, String> conf = withRestPort(baseConf, port);
            int slots = Math.max(from, to);
            conf.put("taskmanager.numberOfTaskSlots", Integer.toString(slots));
            conf.put("classloader.resolve-order", "parent-first"); // the job's classes are on the class path
            MiniCluster cluster = new MiniCluster(new MiniClusterConfiguration.Builder()
                    .setConfiguration(Configuration.fromMap(conf))
                    .setNumTaskManagers(1)
                    .setNumSlotsPerTaskManager(slots)
                    .build());
            cluster.start();
            Path spDir = Files.createTempDirectory("flink-rescale-savepoint-");
            try {
                String base = "http://127.0.0.1:" + port;
                StreamExecutionEnvironment env = StreamExecutionEnvironment.createRemoteEnvironment(
                        "127.0.0.1", port, Configuration.fromMap(conf));
                env.setParallelism(from);
                JobClient job = addPipeline(env, sinkRate).executeAsync("spillover-reference-rescale-" + round);
                String jobId = job.getJobID().toHexString();
                waitRunning(http, json, base, jobId, 120_000);
                long runningAt = System.nanoTime();
                Thread.sleep((long) (warmup * 1000));
                waitCheckpoints(http, json, base, jobId, 2, runningAt);
                LATER_PARALLELISM = to;
                long req = System.nanoTime();
                String path = job.stopWithSavepoint(false, spDir.toUri().toString(),
                        org.apache.flink.core.execution.SavepointFormatType.CANONICAL).get(10, TimeUnit.MINUTES);
                long savedAt = System.nanoTime();
                Map<String, String> conf2 = new LinkedHashMap<>(conf);
                conf2.put("execution.state-recovery.path", path);
                StreamExecutionEnvironment env2 = StreamExecutionEnvironment.createRemoteEnvironment(
                        "127.0.0.1", port, Configuration.fromMap(conf2));
                env2.setParallelism(to);
                JobClient job2 = addPipeline(env2, sinkRate).executeAsync("spillover-reference-rescaled-" + round);
                String jobId2 = job2.getJobID().toHexString();
                long submittedAt = System.nanoTime();
                while (LATER_FIRST.get() == 0 && System.nanoTime() - req < 120_000_000_000L) {
                    Thread.sleep(1);
                }
                Thread.sleep(200); // every task of the new job opened by then
                long last = LATER_OPEN_LAST.get();
                Double runningMs = last == 0 ? null : round((last - req) / 1e6, 1);
                long first = LATER_FIRST.get();
                Double firstMs = first == 0 ? null : round((first - req) / 1e6, 1);
                JsonNode restored = getJson(http, json, base + "/jobs/" + jobId2 + "/checkpoints")
                        .path("latest").path("restored");
                Map<String, Object> r = new LinkedHashMap<>();
                r.put("round", round);
                r.put("savepoint_ms", round((savedAt - req) / 1e6, 1));
                r.put("submitted_ms", round((submittedAt - req) / 1e6, 1));
                r.put("running_ms", runningMs);
                r.put("first_record_ms", firstMs);
                r.put("restored_external_path", restored.path("external_path").asText(null));
                r.put("restored_is_savepoint", restored.path("is_savepoint").asBoolean(false));
                out.add(r);
                saved.add(round((savedAt - req) / 1e6, 1));
                if (runningMs != null) {
                    running.add(runningMs);
                }
                if (firstMs != null) {
                    firsts.add(firstMs);
                }
                log("rescale %d: savepoint %.1f ms, running %s ms, first record at %d %s ms after the stop request",
                        round, (savedAt - req) / 1e6, runningMs, to, firstMs);
                try {
                    job2.cancel().get(60, TimeUnit.SECONDS);
                } catch (Exception e) {
                    log("cancel: %s", e);
                }
            } finally {
                cluster.close();
                deleteTree(spDir);
            }
        }
        Map<String, Object> r = result("rescale", policy, baseConf);
        r.put("from_parallelism", from);
        r.put("to_parallelism", to);
        r.put("sink_rate_per_subtask", sinkRate);
        r.put("warmup_s", warmup);
        r.put("rounds", out);
        spread(r, "savepoint_ms", saved);
        spread(r, "running_ms", running);
        spread(r, "first_record_ms", firsts);
        emit(json, r);
    }

    // -------------------------------------------------------------- helpers

    /** A result's leading fields, in the order every mode prints them (no mode: the plain run). */
    static Map<String, Object> result(String mode, String policy, Map<String, String> conf) {
        Map<String, Object> r = new LinkedHashMap<>();
        r.put("engine", "flink");
        r.put("flink_version", EnvironmentInformation.getVersion());
        r.put("java_version", System.getProperty("java.version"));
        if (mode != null) {
            r.put("mode", mode);
        }
        r.put("policy", policy);
        r.put("config", conf);
        return r;
    }

    /** A copy of conf whose REST endpoint binds to and is reached at port. */
    static Map<String, String> withRestPort(Map<String, String> conf, int port) {
        Map<String, String> out = new LinkedHashMap<>(conf);
        for (String k : List.of("rest.bind-port", "rest.port")) {
            out.put(k, Integer.toString(port));
        }
        return out;
    }

    /** Prints a result on its own line for run.py to pick up. */
    static void emit(ObjectMapper json, Map<String, Object> r) throws IOException {
        System.out.println(RESULT_PREFIX + json.writeValueAsString(r));
        System.out.flush();
    }

    /** name_median, name_min and name_max of xs (null when there are none). */
    static void spread(Map<String, Object> r, String name, List<Double> xs) {
        r.put(name + "_median", pct(xs, 50));
        r.put(name + "_min", xs.isEmpty() ? null : Collections.min(xs));
        r.put(name + "_max", xs.isEmpty() ? null : Collections.max(xs));
    }

    static Double pct(List<Double> xs, double p) {
        if (xs.isEmpty()) {
            return null;
        }
        List<Double> s = new ArrayList<>(xs);
        Collections.sort(s);
        double pos = (s.size() - 1) * p / 100.0; // linear interpolation between ranks
        int lo = (int) Math.floor(pos);
        int hi = (int) Math.ceil(pos);
        return round(s.get(lo) + (s.get(hi) - s.get(lo)) * (pos - lo), 3);
    }

    static double round(double x, int digits) {
        double f = Math.pow(10, digits);
        return Math.round(x * f) / f;
    }

    static JsonNode getJson(HttpClient http, ObjectMapper json, String url)
            throws IOException, InterruptedException {
        HttpResponse<String> resp = http.send(
                HttpRequest.newBuilder(URI.create(url)).timeout(Duration.ofSeconds(30)).GET().build(),
                HttpResponse.BodyHandlers.ofString());
        if (resp.statusCode() != 200) {
            throw new IOException("GET " + url + " -> HTTP " + resp.statusCode() + ": " + resp.body());
        }
        return json.readTree(resp.body());
    }

    static void waitRunning(HttpClient http, ObjectMapper json, String base, String jobId, long timeoutMs)
            throws Exception {
        long deadline = System.currentTimeMillis() + timeoutMs;
        String last = "?";
        while (System.currentTimeMillis() < deadline) {
            try {
                JsonNode j = getJson(http, json, base + "/jobs/" + jobId);
                last = j.path("state").asText();
                boolean all = j.path("vertices").size() > 0;
                for (JsonNode v : j.path("vertices")) {
                    all &= "RUNNING".equals(v.path("status").asText());
                }
                if (all && "RUNNING".equals(last)) {
                    return;
                }
                if ("FAILED".equals(last) || "CANCELED".equals(last) || "FINISHED".equals(last)) {
                    break;
                }
            } catch (IOException e) {
                last = e.toString();
            }
            Thread.sleep(200);
        }
        throw new IllegalStateException("job " + jobId + " did not reach RUNNING (last: " + last + ")");
    }

    static int freeLocalPort() throws IOException {
        try (ServerSocket s = new ServerSocket(0, 1, InetAddress.getLoopbackAddress())) {
            return s.getLocalPort();
        }
    }

    static void deleteTree(Path p) {
        try (var walk = Files.walk(p)) {
            walk.sorted(Comparator.reverseOrder()).forEach(q -> q.toFile().delete());
        } catch (IOException ignored) {
            // best effort
        }
    }

    static Map<String, String> parseArgs(String[] argv) {
        Map<String, String> m = new HashMap<>();
        for (int i = 0; i < argv.length; i++) {
            String a = argv[i];
            if (!a.startsWith("--") || i + 1 >= argv.length) {
                throw new IllegalArgumentException("usage: --name value ... (bad argument " + a + ")");
            }
            m.put(a.substring(2), argv[++i]);
        }
        return m;
    }

    static void log(String fmt, Object... a) {
        System.err.println("[flink-bench] " + String.format(Locale.ROOT, fmt, a));
    }
}
