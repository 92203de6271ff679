package io.checkpointsidecar;

import java.io.EOFException;
import java.io.IOException;
import java.io.InterruptedIOException;
import java.nio.ByteBuffer;
import java.nio.channels.SelectionKey;
import java.nio.channels.Selector;
import java.nio.channels.SocketChannel;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Delivers the latest progress of each query to the daemon.
 *
 * <pre>
 *  Spark's listener thread          I/O thread "checkpoint-sidecar-sender"      daemon
 *  offer(query, payload) ──▶ latest[query] = payload   (one slot per query: latest wins)
 *  return (O(1), no I/O)            │ notify
 *                                   ▼
 *                        take every slot ─▶ payload.json() ─▶ one write ────────────▶
 *                        read the replies in order ◀─────────────────────────────────
 *                        ok: sent · retriable: back into the slot unless superseded,
 *                        jittered backoff · other errors: failed, logged
 * </pre>
 *
 * <p>Invariants: the lock is never held across I/O; only the I/O thread touches the channel
 * (others ask it to stop through {@code closing} and {@link Selector#wakeup()}); memory is one
 * slot per query, whatever the event rate or the length of an outage.
 *
 * <p>One sender per endpoint is shared by every listener in the JVM ({@link #acquire}), so a
 * Spark Connect server, which builds one listener per client session, keeps one connection.
 */
final class Sender {
  // Named by string: the sender runs without Spark's classes (conformance tests).
  private static final Logger LOG = LoggerFactory.getLogger("io.checkpointsidecar.SidecarStreamingListener");

  static Logger log() {
    return LOG;
  }

  /** What a slot holds: Spark's progress, serialized only when (and if) it is sent. */
  interface Payload {
    String json();
  }

  // --- the shared registry ---------------------------------------------------------------

  private static final Map<String, Sender> SHARED = new HashMap<>();

  /** The sender for {@code settings}' endpoint, started on first use; pair with {@link #release}. */
  static Sender acquire(Settings settings) {
    synchronized (SHARED) {
      String endpoint = settings.endpoint();
      Sender sender = SHARED.get(endpoint);
      if (sender == null) {
        sender = new Sender(settings, endpoint);
        sender.start();
        SHARED.put(endpoint, sender);
      }
      sender.users++;
      return sender;
    }
  }

  /** Drop one user; the last one flushes (bounded by {@code timeoutMs}) and stops the thread. */
  boolean release(long timeoutMs) {
    synchronized (SHARED) {
      if (--users > 0) return flush(timeoutMs);
      SHARED.remove(endpoint);
    }
    boolean delivered = close(timeoutMs);
    try {
      Runtime.getRuntime().removeShutdownHook(shutdownHook);
    } catch (IllegalStateException alreadyShuttingDown) {
      // the hook runs or ran; nothing to undo
    }
    return delivered;
  }

  // --- state, guarded by lock ------------------------------------------------------------------

  private final Settings settings;
  final String endpoint;
  private final Object lock = new Object();
  private final LinkedHashMap<String, Payload> latest = new LinkedHashMap<>();
  private final Set<String> inFlight = new HashSet<>();
  private boolean closing;
  private int users; // guarded by SHARED
  private long offered, sent, conflated, failed, retried, reconnects;
  private String lastError;

  // --- owned by the I/O thread -----------------------------------------------------------------

  private final Thread thread;
  private final Thread shutdownHook;
  private final Selector selector;
  private SocketChannel channel;
  private boolean connectedOnce;
  private long nextId = 1;
  private long backoffMs;
  private long downSinceNs = -1;
  private final ByteBuffer readBuffer = ByteBuffer.allocate(64 * 1024);

  Sender(Settings settings, String endpoint) {
    this.settings = settings;
    this.endpoint = endpoint;
    this.backoffMs = settings.backoffMinMs;
    try {
      this.selector = Selector.open();
    } catch (IOException e) {
      throw new IllegalStateException("checkpoint-sidecar: cannot open a selector: " + e, e);
    }
    this.thread = new Thread(this::run, "checkpoint-sidecar-sender");
    this.thread.setDaemon(true);
    this.shutdownHook = new Thread(this::onJvmShutdown, "checkpoint-sidecar-shutdown");
  }

  void start() {
    thread.start();
    Runtime.getRuntime().addShutdownHook(shutdownHook);
    LOG.info("checkpoint-sidecar listener sends to {} (flush on query stop within {} ms)",
        endpoint, settings.terminateWaitMs);
  }

  // --- Spark's thread ------------------------------------------------------------------------

  /** Keep {@code payload} as the latest progress of {@code queryId}. Never blocks on I/O. */
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
      } else if (latest.size() >= settings.maxQueries) {
        failed++;
        lastError = "more than " + settings.maxQueries + " queries pending; dropped";
        return;
      }
      latest.put(queryId, payload);
      lock.notifyAll();
    }
  }

  // --- waiting for delivery ----------------------------------------------------------------------

  /** Wait until every update offered so far is settled; false on timeout or close. */
  boolean flush(long timeoutMs) {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
    synchronized (lock) {
      while (!latest.isEmpty() || !inFlight.isEmpty()) {
        if (!waitUntil(deadline) || (closing && !thread.isAlive())) return false;
      }
      return true;
    }
  }

  /** Wait until {@code queryId} has nothing pending or in flight; false on timeout. */
  boolean awaitQuery(String queryId, long timeoutMs) {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
    synchronized (lock) {
      while (latest.containsKey(queryId) || inFlight.contains(queryId)) {
        if (!waitUntil(deadline) || (closing && !thread.isAlive())) return false;
      }
      return true;
    }
  }

  private boolean waitUntil(long deadlineNs) {
    return waitOn(lock, deadlineNs);
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

  /** Flush within {@code timeoutMs}, then stop the I/O thread. True if everything was delivered. */
  boolean close(long timeoutMs) {
    boolean delivered = flush(timeoutMs);
    synchronized (lock) {
      closing = true;
      lock.notifyAll();
    }
    selector.wakeup();
    try {
      thread.join(2000);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
    return delivered;
  }

  private void onJvmShutdown() {
    boolean delivered = flush(settings.shutdownWaitMs);
    String stats = statsJson();
    if (delivered) {
      LOG.info("checkpoint-sidecar listener at JVM shutdown: everything delivered; {}", stats);
    } else {
      LOG.warn("checkpoint-sidecar listener at JVM shutdown: updates left undelivered after {} ms; {}",
          settings.shutdownWaitMs, stats);
    }
  }

  // --- stats -----------------------------------------------------------------------------------

  String statsJson() {
    synchronized (lock) {
      Set<String> pending = new HashSet<>(inFlight);
      pending.addAll(latest.keySet());
      return "{\"offered\":" + offered + ",\"sent\":" + sent + ",\"conflated\":" + conflated
          + ",\"failed\":" + failed + ",\"retried\":" + retried + ",\"reconnects\":" + reconnects
          + ",\"pending\":" + pending.size()
          + ",\"last_error\":" + (lastError == null ? "null" : Json.quote(lastError))
          + ",\"endpoint\":" + Json.quote(endpoint) + "}";
    }
  }

  // --- the I/O thread ----------------------------------------------------------------------------

  private void run() {
    try {
      while (true) {
        List<Map.Entry<String, Payload>> batch;
        synchronized (lock) {
          while (latest.isEmpty() && !closing) lock.wait();
          if (closing) break;
          batch = new ArrayList<>(latest.entrySet());
          latest.clear();
          for (Map.Entry<String, Payload> e : batch) inFlight.add(e.getKey());
        }
        boolean retry = deliver(batch);
        if (retry) backoff(); else backoffMs = settings.backoffMinMs;
      }
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    } catch (RuntimeException | Error e) {
      LOG.error("checkpoint-sidecar sender thread failed; offsets are no longer delivered", e);
      synchronized (lock) {
        lastError = "sender thread failed: " + e;
      }
    } finally {
      disconnect();
      try {
        selector.close();
      } catch (IOException ignored) {
        // closing
      }
      synchronized (lock) {
        closing = true;
        lock.notifyAll();
      }
    }
  }

  /** Send one batch and settle every update in it. True if some must be retried. */
  private boolean deliver(List<Map.Entry<String, Payload>> batch) {
    long firstId = nextId;
    List<Wire.Reply> replies = new ArrayList<>(batch.size());
    List<byte[]> frames = new ArrayList<>(batch.size());
    String failure = null;
    try {
      int size = 0;
      for (Map.Entry<String, Payload> e : batch) {
        byte[] frame = Wire.progressRequest(nextId++, e.getValue().json());
        frames.add(frame);
        size += frame.length;
      }
      ByteBuffer out = ByteBuffer.allocate(size);
      for (byte[] frame : frames) out.put(frame);
      out.flip();
      SocketChannel ch = connect();
      IOException writeError = null;
      try {
        write(ch, out);
      } catch (IOException e) {
        // The daemon may have answered part of the batch and closed (frame_too_large): read
        // what it sent before settling, so those replies count and only the rest is resent.
        writeError = e;
      }
      Wire.ReplyDecoder decoder = new Wire.ReplyDecoder();
      long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(
          writeError == null ? settings.replyTimeoutMs : settings.connectTimeoutMs);
      while (replies.size() < batch.size()) {
        readBuffer.clear();
        if (read(ch, readBuffer, deadline) < 0) {
          throw writeError != null ? writeError : new EOFException("the daemon closed the connection");
        }
        for (Wire.Reply r : decoder.feed(readBuffer.array(), 0, readBuffer.position())) {
          long expected = firstId + replies.size();
          if (r.id != null && !(r.id instanceof Long && (Long) r.id == expected)) {
            throw new Wire.ProtocolViolation("reply id " + r.id + " where " + expected + " was due");
          }
          if (r.id == null && r.ok) throw new Wire.ProtocolViolation("a success reply without the request's id");
          replies.add(r);
          if (replies.size() > batch.size()) throw new Wire.ProtocolViolation("more replies than requests");
        }
      }
    } catch (IOException | Wire.ProtocolViolation | RuntimeException e) {
      // RuntimeException: Spark's json() failed for one payload, or a channel misbehaved; the
      // connection state is unknown either way, so it is dropped.
      failure = e instanceof IOException ? e.getMessage() : e.toString();
      if (failure == null) failure = e.getClass().getSimpleName();
      disconnect();
    }
    for (Wire.Reply r : replies) {
      if (r.closesConnection()) disconnect(); // the daemon closes after it; do not write into it
    }
    if (failure == null && downSinceNs >= 0) {
      LOG.info("checkpoint-sidecar at {} reachable again after {} ms", endpoint,
          TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - downSinceNs));
      downSinceNs = -1;
    } else if (failure != null && replies.isEmpty() && downSinceNs < 0) {
      downSinceNs = System.nanoTime();
      LOG.warn("checkpoint-sidecar at {} unreachable ({}); keeping the latest offsets of {} query(ies) "
          + "and retrying with backoff", endpoint, failure, batch.size());
    }
    return settle(batch, replies, failure);
  }

  /** Under lock: count every update of the batch; put retriable ones back unless superseded. */
  private boolean settle(List<Map.Entry<String, Payload>> batch, List<Wire.Reply> replies, String failure) {
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
          LOG.warn("checkpoint-sidecar refused the progress of query {}: {}", e.getKey(), r);
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

  /** Jittered exponential backoff; offers do not cut it short, only close() does. */
  private void backoff() throws InterruptedException {
    long sleepMs = backoffMs / 2 + ThreadLocalRandom.current().nextLong(backoffMs / 2 + 1);
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(sleepMs);
    synchronized (lock) {
      long left;
      while (!closing && (left = TimeUnit.NANOSECONDS.toMillis(deadline - System.nanoTime())) > 0) {
        lock.wait(left);
      }
    }
    backoffMs = Math.min(settings.backoffMaxMs, backoffMs * 2);
  }

  // --- channel I/O (non-blocking channel + selector: every wait has a deadline and a wake-up) ----

  private SocketChannel connect() throws IOException {
    if (channel != null) return channel;
    Endpoint.Target target = Endpoint.open(endpoint);
    SocketChannel ch = target.channel;
    try {
      ch.configureBlocking(false);
      if (!ch.connect(target.address)) {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(settings.connectTimeoutMs);
        await(ch, SelectionKey.OP_CONNECT, deadline);
        while (!ch.finishConnect()) await(ch, SelectionKey.OP_CONNECT, deadline);
      }
    } catch (IOException | RuntimeException e) {
      ch.close();
      throw e;
    }
    channel = ch;
    if (connectedOnce) {
      synchronized (lock) {
        reconnects++;
      }
    }
    connectedOnce = true;
    return ch;
  }

  private void write(SocketChannel ch, ByteBuffer buf) throws IOException {
    long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(settings.replyTimeoutMs);
    while (buf.hasRemaining()) {
      if (ch.write(buf) == 0) await(ch, SelectionKey.OP_WRITE, deadline);
    }
  }

  private int read(SocketChannel ch, ByteBuffer buf, long deadline) throws IOException {
    while (true) {
      int n = ch.read(buf);
      if (n != 0) return n;
      await(ch, SelectionKey.OP_READ, deadline);
    }
  }

  private void await(SocketChannel ch, int op, long deadlineNs) throws IOException {
    SelectionKey key = ch.register(selector, op);
    try {
      while (true) {
        synchronized (lock) {
          if (closing) throw new InterruptedIOException("closing");
        }
        long leftMs = TimeUnit.NANOSECONDS.toMillis(deadlineNs - System.nanoTime());
        if (leftMs <= 0) throw new IOException("no answer from the daemon in time");
        selector.select(leftMs);
        Iterator<SelectionKey> it = selector.selectedKeys().iterator();
        boolean ready = false;
        while (it.hasNext()) {
          ready |= it.next() == key;
          it.remove();
        }
        if (ready) return;
      }
    } finally {
      if (key.isValid()) key.interestOps(0);
    }
  }

  private void disconnect() {
    if (channel == null) return;
    try {
      channel.close();
    } catch (IOException ignored) {
      // already broken
    }
    channel = null;
  }
}
