package bench;

import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.util.LinkedHashMap;
import java.util.Map;
import org.apache.spark.sql.streaming.StreamingQueryListener;
import org.apache.spark.sql.streaming.StreamingQueryProgress;

/**
 * Bench-only (bench/listener.py): measures, on Spark's listener thread, the time spent by the
 * listeners registered between {@link Before} and {@link After} on one session.
 *
 * <p>Spark's StreamingQueryListenerBus calls a session's listeners one after another, in
 * registration order, on one thread (the "streams" queue's dispatch thread). {@code Before}
 * takes {@code System.nanoTime()} as the last thing it does, {@code After} as the first; the
 * difference is what the listener(s) in between cost Spark's thread for that event, plus the
 * bus's own dispatch of one listener (measured alone when nothing is in between). The same
 * bracket in the thread's CPU time ({@link ThreadMXBean#getCurrentThreadCpuTime}, read outside
 * the wall-clock bracket) tells work on the thread from time the thread was not running (the
 * machine's other processes, or threads it woke, had the core).
 *
 * <p>Per event {@code After} also records the query, its batch id and Spark's
 * {@code durationMs.triggerExecution}, read after its clock so that they cost nothing inside the
 * bracket. {@link After#drain()} hands the rows to Python over Py4J (one call).
 */
public final class MarkerListener {
  private MarkerListener() {}

  // Written by Before and read by After on the same listener thread, one event after another;
  // never touched by another thread, hence no synchronization.
  private static Object pendingEvent;
  private static Thread pendingThread;
  private static long pendingNanos;
  private static long pendingCpuNanos;
  private static final ThreadMXBean THREADS = ManagementFactory.getThreadMXBean();

  private static final Object LOCK = new Object();
  // Guarded by LOCK: After appends on the listener thread, Python drains over Py4J.
  private static final StringBuilder ROWS = new StringBuilder();
  private static final Map<String, Integer> QUERIES = new LinkedHashMap<>();
  private static long unpaired; // After saw an event Before did not, or on another thread
  private static String threadName = "";

  /** Registered first (by Spark conf): stamps the time as the last thing it does. */
  public static final class Before extends StreamingQueryListener {
    private static final long serialVersionUID = 1L;

    @Override
    public void onQueryStarted(QueryStartedEvent event) {}

    @Override
    public void onQueryProgress(QueryProgressEvent event) {
      pendingEvent = event;
      pendingThread = Thread.currentThread();
      pendingCpuNanos = THREADS.getCurrentThreadCpuTime();
      pendingNanos = System.nanoTime();
    }

    @Override
    public void onQueryTerminated(QueryTerminatedEvent event) {}
  }

  /** Registered last (addListener): stamps the time first, then records the event. */
  public static final class After extends StreamingQueryListener {
    private static final long serialVersionUID = 1L;

    @Override
    public void onQueryStarted(QueryStartedEvent event) {}

    @Override
    public void onQueryProgress(QueryProgressEvent event) {
      long now = System.nanoTime();
      long cpuNanos = THREADS.getCurrentThreadCpuTime() - pendingCpuNanos;
      boolean paired = pendingEvent == event && pendingThread == Thread.currentThread();
      long bracketNanos = now - pendingNanos;
      pendingEvent = null;
      StreamingQueryProgress progress = event.progress();
      Long trigger = progress.durationMs().get("triggerExecution");
      String queryId = progress.id().toString();
      synchronized (LOCK) {
        if (!paired) {
          unpaired++;
          return;
        }
        threadName = Thread.currentThread().getName();
        Integer index = QUERIES.get(queryId);
        if (index == null) {
          index = QUERIES.size();
          QUERIES.put(queryId, index);
        }
        ROWS.append(index).append(',').append(progress.batchId()).append(',')
            .append(trigger == null ? -1L : trigger.longValue()).append(',')
            .append(bracketNanos).append(',').append(cpuNanos).append('\n');
      }
    }

    @Override
    public void onQueryTerminated(QueryTerminatedEvent event) {}

    /** Rows recorded since the last drain, one per event: query index, batch id,
     * triggerExecution ms (-1: absent), nanoseconds between Before and After: wall clock, and
     * the thread's CPU time. */
    public String drain() {
      synchronized (LOCK) {
        String out = ROWS.toString();
        ROWS.setLength(0);
        return out;
      }
    }

    /** Events After saw without Before just before it on the same thread (0 expected). */
    public long unpaired() {
      synchronized (LOCK) {
        return unpaired;
      }
    }

    /** The listener thread's name (Spark's "spark-listener-group-streams"). */
    public String threadName() {
      synchronized (LOCK) {
        return threadName;
      }
    }
  }
}
