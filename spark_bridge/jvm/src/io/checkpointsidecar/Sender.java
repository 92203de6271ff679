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
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Delivers the latest progress of each query to the daemon: the one I/O thread, and the
 * registry that shares it per endpoint.
 *
 * <pre>
 *  Spark's listener thread          {@link Slots}                 I/O thread "checkpoint-sidecar-sender"
 *  offer(query, payload) ──▶ latest[query] = payload ──take()──▶ payload.json() ─▶ one write ──▶ daemon
 *  return (O(1), no I/O)     (one slot per query)                read the replies in order ◀──
 *                                                    ◀─settle()─ ok · retriable (back, backoff) · failed
 * </pre>
 *
 * <p>Invariants: only the I/O thread touches the channel (others ask it to stop through
 * {@link Slots#close} and {@link Selector#wakeup()}); no lock is held across I/O or a wait for
 * it (the slots' lock is taken only inside {@link Slots}; the registry's only to count users).
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

  // --- the shared registry ---------------------------------------------------------------

  private static final Map<String, Sender> SHARED = new HashMap<>();

  /** The sender for {@code settings}' route, started on first use; pair with {@link #release}. */
  static Sender acquire(Settings settings) {
    synchronized (SHARED) {
      Endpoint.Route route = settings.route();
      String endpoint = route.toString();
      Sender sender = SHARED.get(endpoint);
      if (sender == null) {
        sender = new Sender(settings, route);
        sender.start();
        SHARED.put(endpoint, sender);
      }
      sender.users++;
      return sender;
    }
  }

  /**
   * Drop one user; the last one flushes (bounded by {@code timeoutMs}) and stops the thread.
   * The registry's lock is held only to count users: every other listener's {@link #acquire}
   * and release go on while this one waits for its flush (a Spark Connect session closing
   * while the daemon is slow must not hold up the other sessions' listeners).
   */
  boolean release(long timeoutMs) {
    boolean last;
    synchronized (SHARED) {
      last = --users == 0;
      if (last) SHARED.remove(endpoint);
    }
    if (!last) return flush(timeoutMs);
    boolean delivered = close(timeoutMs);
    try {
      Runtime.getRuntime().removeShutdownHook(shutdownHook);
    } catch (IllegalStateException alreadyShuttingDown) {
      // the hook runs or ran; nothing to undo
    }
    return delivered;
  }

  private final Settings settings;
  private final Endpoint.Route route;
  final String endpoint;
  private final Slots slots;
  private int users; // guarded by SHARED

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

  Sender(Settings settings, Endpoint.Route route) {
    this.settings = settings;
    this.route = route;
    this.endpoint = route.toString();
    this.slots = new Slots(settings.maxQueries, endpoint);
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

  // --- any thread --------------------------------------------------------------------------------

  /** Keep {@code payload} as the latest progress of {@code queryId}. Never blocks on I/O. */
  void offer(String queryId, Slots.Payload payload) {
    slots.offer(queryId, payload);
  }

  /** Wait until every update offered so far is settled; false on timeout or close. */
  boolean flush(long timeoutMs) {
    return slots.flush(timeoutMs, thread);
  }

  /** Wait until {@code queryId} has nothing pending or in flight; false on timeout. */
  boolean awaitQuery(String queryId, long timeoutMs) {
    return slots.awaitQuery(queryId, timeoutMs, thread);
  }

  Stats stats() {
    return slots.stats();
  }

  /** Flush within {@code timeoutMs}, then stop the I/O thread. True if everything was delivered. */
  boolean close(long timeoutMs) {
    boolean delivered = flush(timeoutMs);
    slots.close();
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
    String stats = stats().json();
    if (delivered) {
      LOG.info("checkpoint-sidecar listener at JVM shutdown: everything delivered; {}", stats);
    } else {
      LOG.warn("checkpoint-sidecar listener at JVM shutdown: updates left undelivered after {} ms; {}",
          settings.shutdownWaitMs, stats);
    }
  }

  // --- the I/O thread ----------------------------------------------------------------------------

  private void run() {
    try {
      List<Map.Entry<String, Slots.Payload>> batch;
      while ((batch = slots.take()) != null) {
        boolean retry = deliver(batch);
        if (retry) backoff(); else backoffMs = settings.backoffMinMs;
      }
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    } catch (RuntimeException | Error e) {
      LOG.error("checkpoint-sidecar sender thread failed; offsets are no longer delivered", e);
      slots.broken("sender thread failed: " + e);
    } finally {
      disconnect();
      try {
        selector.close();
      } catch (IOException ignored) {
        // closing
      }
      slots.close();
    }
  }

  /** Send one batch and settle every update in it. True if some must be retried. */
  private boolean deliver(List<Map.Entry<String, Slots.Payload>> batch) {
    long firstId = nextId;
    List<Wire.Reply> replies = new ArrayList<>(batch.size());
    List<byte[]> frames = new ArrayList<>(batch.size());
    String failure = null;
    try {
      int size = 0;
      for (Map.Entry<String, Slots.Payload> e : batch) {
        byte[] frame = Wire.progressRequest(nextId++, e.getValue().json(), e.getValue().tracking());
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
    return slots.settle(batch, replies, failure);
  }

  /** Jittered exponential backoff; offers do not cut it short, only close() does. */
  private void backoff() throws InterruptedException {
    slots.pause(backoffMs / 2 + ThreadLocalRandom.current().nextLong(backoffMs / 2 + 1));
    backoffMs = Math.min(settings.backoffMaxMs, backoffMs * 2);
  }

  // --- channel I/O (non-blocking channel + selector: every wait has a deadline and a wake-up) ----

  private SocketChannel connect() throws IOException {
    if (channel != null) return channel;
    Endpoint.Target target = Endpoint.open(route);
    SocketChannel ch = target.channel;
    try {
      ch.configureBlocking(false);
      long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(settings.connectTimeoutMs);
      if (!ch.connect(target.address)) {
        await(ch, SelectionKey.OP_CONNECT, deadline);
        while (!ch.finishConnect()) await(ch, SelectionKey.OP_CONNECT, deadline);
      }
      if (target.token != null) authenticate(ch, target, deadline);
    } catch (IOException | RuntimeException e) {
      ch.close();
      throw e;
    }
    channel = ch;
    if (connectedOnce) slots.reconnected();
    connectedOnce = true;
    return ch;
  }

  /**
   * Send the token and read the daemon's answer before anything else (TCP). A refusal closes
   * the connection; the caller retries with backoff, reading the endpoint file again.
   */
  private void authenticate(SocketChannel ch, Endpoint.Target target, long deadline) throws IOException {
    ByteBuffer out = ByteBuffer.wrap(Wire.authRequest(target.token));
    while (out.hasRemaining()) {
      if (ch.write(out) == 0) await(ch, SelectionKey.OP_WRITE, deadline);
    }
    Wire.ReplyDecoder decoder = new Wire.ReplyDecoder();
    while (true) {
      readBuffer.clear();
      if (read(ch, readBuffer, deadline) < 0) {
        throw new EOFException("the daemon at " + target.address + " closed the connection before answering auth");
      }
      List<Wire.Reply> replies;
      try {
        replies = decoder.feed(readBuffer.array(), 0, readBuffer.position());
      } catch (Wire.ProtocolViolation e) {
        throw new IOException("not the daemon at " + target.address + ": " + e.getMessage());
      }
      if (replies.isEmpty()) continue;
      Wire.Reply reply = replies.get(0);
      if (replies.size() > 1 || !Wire.AUTH_ID.equals(reply.id)) {
        throw new IOException("not the daemon at " + target.address + ": an unexpected reply to auth (" + reply + ")");
      }
      if (!reply.ok) {
        throw new IOException("the daemon at " + target.address + " refused the token of "
            + route.endpointFile() + " (" + reply + "); retrying with the file read again");
      }
      return;
    }
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
        if (slots.closing()) throw new InterruptedIOException("closing");
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
