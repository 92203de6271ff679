package io.checkpointsidecar;

import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.TimeUnit;

/**
 * The latest progress of each query, waiting for the I/O thread: one slot per query, latest
 * wins. No I/O here; every method holds the one lock only for a few map operations.
 *
 * <pre>
 *  offer(query, payload)      (Spark's thread: O(1))   ──▶ latest[query] = payload
 *  take()                     (I/O thread: blocks)     ◀── every slot, now in flight
 *  settle(batch, replies)     (I/O thread)             ──▶ ok: sent · retriable: back into its
 *                                                          slot unless superseded · else failed
 *  flush() / awaitQuery()     (any thread)             ◀── until nothing is waiting or in flight
 * </pre>
 *
 * <p>Memory is one slot per query, whatever the event rate or the length of an outage
 * ({@code maxQueries} slots at most).
 */
final class Slots {
  /** What a slot holds: Spark's progress, serialized only when (and if) it is sent. */
  interface Payload {
    String json();

    /** How the query tracks progress ({@link Tracking}), or null when unknown. */
    default String tracking() {
      return null;
    }
  }

  private final int maxQueries;
  private final String endpoint;
  private final Object lock = new Object();
  private final LinkedHashMap<String, Payload> latest = new LinkedHashMap<>();
  private final Set<String> inFlight = new HashSet<>();
  private boolean closing;
  private long offered, sent, conflated, failed, retried, reconnects;
  private String lastError;

  Slots(int maxQueries, String endpoint) {
    this.maxQueries = maxQueries;
    this.endpoint = endpoint;
  }

  /** Keep {@code payload} as the latest progress of {@code queryId}. Never blocks. */
  void offer(String queryId, Payload payload) {
    synchronized (lock) {
      offered++;
      if (closing) {
        failed++;
        lastError = "offered after close; dropped";
        return;
      }
      if (latest.containsKey(queryId)) {
        conflated++;
      } else if (latest.size() >= maxQueries) {
        failed++;
        lastError = "more than " + maxQueries + " queries pending; dropped";
        return;
      }
      latest.put(queryId, payload);
      lock.notifyAll();
    }
  }

  /** Every waiting slot, now in flight; blocks until there is one. Null once closing. */
  List<Map.Entry<String, Payload>> take() throws InterruptedException {
    synchronized (lock) {
      while (latest.isEmpty() && !closing) lock.wait();
      if (closing) return null;
      List<Map.Entry<String, Payload>> batch = new ArrayList<>(latest.entrySet());
      latest.clear();
      for (Map.Entry<String, Payload> e : batch) inFlight.add(e.getKey());
      return batch;
    }
  }

  /**
   * Count every update of {@code batch} by its reply ({@code replies.get(k)} answers the k-th;
   * missing ones were never answered): ok is sent; retriable or unanswered goes back into its
   * slot unless a newer one took it; anything else failed. {@code failure}: what broke the
   * transport, if something did. True if some must be retried.
   */
  boolean settle(List<Map.Entry<String, Payload>> batch, List<Wire.Reply> replies, String failure) {
    boolean retry = false;
    synchronized (lock) {
      for (int k = 0; k < batch.size(); k++) {
        Map.Entry<String, Payload> e = batch.get(k);
        Wire.Reply r = k < replies.size() ? replies.get(k) : null;
        if (r != null && r.ok) {
          sent++;
        } else if (r == null || r.retriable()) {
          retried++;
          retry = true;
          if (latest.containsKey(e.getKey())) {
            conflated++; // superseded while in flight: the newer one wins
          } else {
            latest.put(e.getKey(), e.getValue());
          }
        } else {
          failed++;
          Sender.log().warn("checkpoint-sidecar refused the progress of query {}: {}", e.getKey(), r);
        }
      }
      // The daemon's own word says more than the transport error it caused.
      if (failure != null) lastError = failure;
      for (Wire.Reply r : replies) if (!r.ok) lastError = r.toString();
      inFlight.clear();
      lock.notifyAll();
    }
    return retry;
  }

  void reconnected() {
    synchronized (lock) {
      reconnects++;
    }
  }

  /** The I/O thread died: nothing is delivered any more. */
  void broken(String why) {
    synchronized (lock) {
      lastError = why;
    }
  }

  /** Stop: offers are dropped, waits end, {@link #take} returns null. */
  void close() {
    synchronized (lock) {
      closing = true;
      lock.notifyAll();
    }
  }

  boolean closing() {
    synchronized (lock) {
      return closing;
    }
  }

  /** Wait until every update offered so far is settled; false on timeout or once {@code gone}. */
  boolean flush(long timeoutMs, Thread io) {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
    synchronized (lock) {
      while (!latest.isEmpty() || !inFlight.isEmpty()) {
        if (!waitOn(lock, deadline) || (closing && !io.isAlive())) return false;
      }
      return true;
    }
  }

  /** Wait until {@code queryId} has nothing waiting or in flight; false on timeout. */
  boolean awaitQuery(String queryId, long timeoutMs, Thread io) {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
    synchronized (lock) {
      while (latest.containsKey(queryId) || inFlight.contains(queryId)) {
        if (!waitOn(lock, deadline) || (closing && !io.isAlive())) return false;
      }
      return true;
    }
  }

  /** Sleep {@code ms}, cut short only by {@link #close}. */
  void pause(long ms) throws InterruptedException {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(ms);
    synchronized (lock) {
      long left;
      while (!closing && (left = TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime())) > 0) {
        lock.wait(left);
      }
    }
  }

  Stats stats() {
    synchronized (lock) {
      Set<String> pending = new HashSet<>(inFlight);
      pending.addAll(latest.keySet());
      return new Stats(offered, sent, conflated, failed, retried, reconnects, pending.size(),
          lastError, endpoint, 0);
    }
  }

  /**
   * Holding {@code monitor}: wait on it until notified or the deadline; false once the deadline
   * has passed (or the thread was interrupted: the interrupt is kept).
   */
  static boolean waitOn(Object monitor, long deadlineNs) {
    long leftMs = TimeUnit.NANOSECONDS.toMillis(deadlineNs - System.nanoTime());
    if (leftMs <= 0) return false;
    try {
      monitor.wait(leftMs);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      return false;
    }
    return true;
  }
}
