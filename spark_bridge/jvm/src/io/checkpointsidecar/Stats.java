package io.checkpointsidecar;

/**
 * The delivery counters of a sender, taken at one moment: a value, serialised once.
 *
 * <p>{@code pending}: queries with an update waiting or in flight. {@code listenerErrors}: the
 * listener's own failures on Spark's events (never raised into Spark), added by the listener.
 */
final class Stats {
  final long offered, sent, conflated, failed, retried, reconnects, pending, listenerErrors;
  final String lastError; // null: none
  final String endpoint;

  Stats(long offered, long sent, long conflated, long failed, long retried, long reconnects,
      long pending, String lastError, String endpoint, long listenerErrors) {
    this.offered = offered;
    this.sent = sent;
    this.conflated = conflated;
    this.failed = failed;
    this.retried = retried;
    this.reconnects = reconnects;
    this.pending = pending;
    this.lastError = lastError;
    this.endpoint = endpoint;
    this.listenerErrors = listenerErrors;
  }

  /** These counters with the listener's own error count. */
  Stats withListenerErrors(long errors) {
    return new Stats(offered, sent, conflated, failed, retried, reconnects, pending, lastError,
        endpoint, errors);
  }

  /**
   * As JSON: offered, sent, conflated, failed, retried, reconnects, pending, last_error,
   * endpoint, listener_errors (what {@code spark_bridge.handle.SenderStats} reads).
   */
  String json() {
    return "{\"offered\":" + offered + ",\"sent\":" + sent + ",\"conflated\":" + conflated
        + ",\"failed\":" + failed + ",\"retried\":" + retried + ",\"reconnects\":" + reconnects
        + ",\"pending\":" + pending
        + ",\"last_error\":" + (lastError == null ? "null" : Json.quote(lastError))
        + ",\"endpoint\":" + Json.quote(endpoint) + ",\"listener_errors\":" + listenerErrors + "}";
  }
}
