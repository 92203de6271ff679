package io.checkpointsidecar;

import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.spark.SparkConf;
import org.apache.spark.SparkEnv;
import org.apache.spark.sql.streaming.StreamingQueryListener;
import org.apache.spark.sql.streaming.StreamingQueryProgress;
import scala.Tuple2;

/**
 * Posts every finished micro-batch's progress to the checkpoint-sidecar daemon.
 *
 * <p>Register it by configuration alone (no code in the job):
 *
 * <pre>
 * spark-submit --jars "$(checkpoint-sidecar listener-jar)" \
 *   --conf spark.sql.streaming.streamingQueryListeners=io.checkpointsidecar.SidecarStreamingListener ...
 * </pre>
 *
 * <p>On Spark's listener thread it does O(1) work: it puts the progress object into the query's
 * slot (latest wins) and returns; Spark's JSON is produced on the sender's own thread, only for
 * the progress that is actually sent. It never throws into Spark and never blocks Spark's thread
 * on I/O, except {@link #onQueryTerminated}, which waits (bounded by {@code terminateWaitMs},
 * default 2 s) until the stopped query's last progress is acknowledged: Spark posts the
 * terminated event after the query's last progress, so a stopped query's final batch is not lost.
 *
 * <p>Settings ({@code spark.checkpointSidecar.*}, then the driver's environment): {@code
 * socketPath} / SIDECAR_SOCKET_PATH; when the JVM has no Unix sockets (Java &lt; 16), or with
 * {@code transport=tcp}, loopback TCP to the port and with the token the daemon publishes in
 * {@code <socketPath>.tcp} ({@code tcpPort} / SIDECAR_TCP_PORT: a fixed port), {@code terminateWaitMs}, {@code
 * shutdownWaitMs}, {@code replyTimeoutMs}, {@code connectTimeoutMs}. See docs/spark-bridge.md.
 */
public class SidecarStreamingListener extends StreamingQueryListener {
  // StreamingQueryListener is Serializable; this listener lives in the driver and is never
  // shipped anywhere, so its state is transient.
  private static final long serialVersionUID = 1L;
  private final transient Sender sender;
  private final long terminateWaitMs;
  private final transient Object lock = new Object();
  /** Queries started or progressing, and not yet terminated (guarded by lock). */
  private final transient Set<String> running = new HashSet<>();
  private volatile boolean closed;
  private final transient AtomicLong errors = new AtomicLong();
  /** Each running query's {@link Tracking} ("" when unknown), found at its first event. */
  private final transient Map<String, String> tracking = new ConcurrentHashMap<>();

  /** Used by {@code spark.sql.streaming.streamingQueryListeners}: Spark passes its conf. */
  public SidecarStreamingListener(SparkConf conf) {
    this(fromSparkConf(conf));
  }

  /** Settings from the running SparkEnv's conf (when there is one) and the environment. */
  public SidecarStreamingListener() {
    this(fromSparkConf(SparkEnv.get() == null ? null : SparkEnv.get().conf()));
  }

  /**
   * Explicit settings, keys without the {@code spark.checkpointSidecar.} prefix (what {@code
   * spark_bridge.attach} uses); missing keys fall back to the environment, then defaults.
   *
   * @throws IllegalArgumentException an unknown key or a bad value
   */
  public SidecarStreamingListener(Map<String, String> settings) {
    Settings s = new Settings(settings, System.getenv());
    this.sender = Sender.acquire(s);
    this.terminateWaitMs = s.terminateWaitMs;
  }

  private static Map<String, String> fromSparkConf(SparkConf conf) {
    Map<String, String> out = new HashMap<>();
    if (conf == null) return out;
    for (Tuple2<String, String> kv : conf.getAllWithPrefix(Settings.PREFIX)) out.put(kv._1(), kv._2());
    return out;
  }

  // --- Spark's listener thread ------------------------------------------------------------------

  @Override
  public void onQueryStarted(QueryStartedEvent event) {
    // Called synchronously inside query.start(): one set insert, so that close() waits for
    // this query's terminated event even when none of its progress has arrived yet.
    try {
      synchronized (lock) {
        running.add(event.id().toString());
      }
      trackingOf(event.id());
    } catch (RuntimeException e) {
      countError(e);
    }
  }

  @Override
  public void onQueryProgress(QueryProgressEvent event) {
    try {
      final StreamingQueryProgress progress = event.progress();
      String queryId = progress.id().toString();
      synchronized (lock) {
        running.add(queryId);
      }
      // StreamingQueryProgress is immutable: serializing it later, on the sender's thread,
      // reads the same values and keeps Spark's thread free of the JSON work.
      final String how = trackingOf(progress.id());
      sender.offer(
          queryId,
          new Slots.Payload() {
            @Override
            public String json() {
              return progress.json();
            }

            @Override
            public String tracking() {
              return how;
            }
          });
    } catch (RuntimeException e) { // never into Spark
      countError(e);
    }
  }

  @Override
  public void onQueryTerminated(QueryTerminatedEvent event) {
    try {
      String queryId = event.id().toString();
      if (!closed && !sender.awaitQuery(queryId, terminateWaitMs)) {
        Sender.log().warn("query {} terminated with its last offsets not yet acknowledged by "
            + "checkpoint-sidecar after {} ms; they stay queued and are retried; {}",
            queryId, terminateWaitMs, sender.stats().json());
      }
      synchronized (lock) {
        running.remove(queryId);
        lock.notifyAll();
      }
      tracking.remove(queryId);
    } catch (RuntimeException e) {
      countError(e);
    }
  }

  /** The query's tracking, looked up once (its first event); null when unknown. */
  private String trackingOf(UUID queryId) {
    String how = tracking.computeIfAbsent(queryId.toString(), k -> {
      String found = Tracking.of(queryId);
      return found == null ? "" : found;
    });
    return how.isEmpty() ? null : how;
  }

  private void countError(RuntimeException e) {
    long n = errors.incrementAndGet(); // onQueryStarted runs on the thread calling start()
    if (n <= 3) Sender.log().error("checkpoint-sidecar listener failed on an event (never raised into Spark)", e);
  }

  // --- control, for spark_bridge and tests (through Py4J) -----------------------------------

  /** Counters as JSON: offered, sent, conflated, failed, retried, reconnects, pending, last_error, endpoint, listener_errors. */
  public String statsJson() {
    return sender.stats().withListenerErrors(errors.get()).json();
  }

  /** Wait until everything offered so far is settled; false on timeout. */
  public boolean flush(long timeoutMs) {
    return sender.flush(timeoutMs);
  }

  /**
   * Wait until every query this listener saw start or progress, other than {@code activeQueryIds}
   * (comma-separated), has had its terminated event handled. Spark's listener bus is asynchronous: a query that
   * {@code stop()} returned for may still have its last progress and terminated events queued.
   */
  public boolean awaitTerminated(String activeQueryIds, long timeoutMs) {
    Set<String> active = new HashSet<>();
    Collections.addAll(active, activeQueryIds.split(","));
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
    synchronized (lock) {
      while (true) {
        boolean waiting = false;
        for (String q : running) waiting |= !active.contains(q);
        if (!waiting) return true;
        if (!Slots.waitOn(lock, deadline)) return false;
      }
    }
  }

  /**
   * Stop using the shared sender: flush within {@code timeoutMs}; the last listener of an endpoint
   * also stops its thread. Call after removing the listener from the session. True if everything
   * offered was acknowledged.
   */
  public boolean close(long timeoutMs) {
    if (closed) return sender.flush(0);
    closed = true;
    return sender.release(timeoutMs);
  }
}
