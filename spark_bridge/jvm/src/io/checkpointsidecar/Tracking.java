package io.checkpointsidecar;

import java.lang.reflect.Method;
import java.util.UUID;

/**
 * How a running query tracks progress, read from its execution object: {@code "sync"} (Spark's
 * default micro-batch execution: offsets and commits logs written every batch), {@code "async"}
 * ({@code asyncProgressTrackingEnabled}: the logs are written every interval, progress reported
 * every batch), {@code "real_time"} (Spark 4.1's real-time trigger), or null when it cannot be
 * told (another Spark, continuous processing, the query not found).
 *
 * <p>Spark's listener API does not say it, so this looks the query up in the active or default
 * session's {@code streams()} and reads the class of its execution and trigger, by reflection:
 * the jar stays loadable on Spark 3.5 and 4.x, whose session classes differ. It runs once per
 * query (its first event), never throws, and costs microseconds.
 */
final class Tracking {
  static final String SYNC = "sync";
  static final String ASYNC = "async";
  static final String REAL_TIME = "real_time";

  private Tracking() {}

  static String of(UUID queryId) {
    try {
      Class<?> sessions = Class.forName("org.apache.spark.sql.SparkSession");
      for (String getter : new String[] {"getActiveSession", "getDefaultSession"}) {
        Object option = sessions.getMethod(getter).invoke(null);
        if (!(option instanceof scala.Option) || ((scala.Option<?>) option).isEmpty()) continue;
        Object session = ((scala.Option<?>) option).get();
        Object streams = call(session, "streams");
        Method get = streams.getClass().getMethod("get", UUID.class);
        Object query = get.invoke(streams, queryId);
        if (query == null) continue;
        return classify(call(query, "streamingQuery"));
      }
    } catch (ReflectiveOperationException | RuntimeException | LinkageError e) {
      // Unknown: the daemon records no position kind for this query.
    }
    return null;
  }

  /** The tracking of a StreamExecution, from its class and its trigger's class. */
  static String classify(Object execution) throws ReflectiveOperationException {
    String kind = execution.getClass().getSimpleName();
    Object trigger = call(execution, "trigger");
    if (trigger != null && trigger.getClass().getSimpleName().startsWith("RealTime")) {
      return REAL_TIME;
    }
    if (kind.startsWith("AsyncProgressTracking")) return ASYNC;
    if (kind.equals("MicroBatchExecution")) return SYNC;
    return null;
  }

  private static Object call(Object target, String method) throws ReflectiveOperationException {
    return target.getClass().getMethod(method).invoke(target);
  }
}
