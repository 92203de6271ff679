package io.checkpointsidecar;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * The daemon's NDJSON protocol as the listener speaks it. Sans-IO: bytes in, replies out; no
 * sockets, no threads (the same split as {@code sidecar/wire/protocol.py}, which is the reference;
 * see docs/protocol.md).
 */
final class Wire {
  private Wire() { }

  /**
   * Error codes after which resending the same update can succeed. Must equal {@code
   * sidecar.wire.protocol.RETRIABLE_CODES}; a conformance test compares the two.
   */
  static final Set<String> RETRIABLE =
      Collections.unmodifiableSet(
          new HashSet<>(
              Arrays.asList(
                  "unavailable", "not_durable", "not_owner", "shutting_down", "internal")));

  /** Error codes after which the daemon closes the connection ({@code sidecar.wire.protocol.CLOSING_CODES}). */
  static final Set<String> CLOSING =
      Collections.unmodifiableSet(new HashSet<>(Arrays.asList("frame_too_large", "unauthenticated")));

  /** The id of the {@code auth} request ({@code sidecar.wire.protocol.AUTH_ID}). */
  static final String AUTH_ID = "auth";

  /**
   * Cap on one reply line. The daemon's largest reply is a {@code get} with a checkpoint (we send
   * none); progress replies are under 200 bytes, errors under a few KiB. A longer line means the
   * peer is not our daemon, and holding more than this would let it grow our heap.
   */
  static final int MAX_REPLY_BYTES = 1 << 20;

  /** One {@code progress} request line; {@code progressJson} is Spark's compact progress JSON. */
  static byte[] progressRequest(long id, String progressJson) {
    return progressRequest(id, progressJson, null);
  }

  /**
   * One {@code progress} request line with the query's {@code tracking} ("sync", "async",
   * "real_time"; null: left out).
   */
  static byte[] progressRequest(long id, String progressJson, String tracking) {
    // Spark's json() is compact; a raw line break could only come from a non-JSON payload and
    // would split the frame, so it becomes a space (legal JSON white space outside strings).
    String body = progressJson;
    if (body.indexOf('\n') >= 0 || body.indexOf('\r') >= 0) {
      body = body.replace('\n', ' ').replace('\r', ' ');
    }
    String extra = tracking == null ? "" : ",\"tracking\":\"" + tracking + "\"";
    String line =
        "{\"op\":\"progress\",\"id\":" + id + extra + ",\"progress\":" + body + "}\n";
    return line.getBytes(StandardCharsets.UTF_8);
  }

  /**
   * The {@code auth} request a TCP connection starts with: the daemon serves it only after this,
   * with the token from its endpoint file.
   */
  static byte[] authRequest(String token) {
    String line = "{\"op\":\"auth\",\"id\":" + Json.quote(AUTH_ID) + ",\"token\":" + Json.quote(token) + "}\n";
    return line.getBytes(StandardCharsets.UTF_8);
  }

  /** A reply as the listener needs it. */
  static final class Reply {
    /** The echoed request id: a Long, a String, or null (e.g. {@code frame_too_large}). */
    final Object id;
    final boolean ok;
    final String errorCode;
    final String errorMessage;

    Reply(Object id, boolean ok, String errorCode, String errorMessage) {
      this.id = id;
      this.ok = ok;
      this.errorCode = errorCode;
      this.errorMessage = errorMessage;
    }

    boolean closesConnection() {
      return !ok && CLOSING.contains(errorCode);
    }

    boolean retriable() {
      return !ok && RETRIABLE.contains(errorCode);
    }

    @Override public String toString() {
      return ok ? "ok" : errorCode + ": " + errorMessage;
    }
  }

  /** The peer sent something that is not a valid reply: the connection must be dropped. */
  static final class ProtocolViolation extends Exception {
    private static final long serialVersionUID = 1L;
    ProtocolViolation(String message) { super(message); }
  }

  /** Splits reply bytes into lines and decodes them. Incremental; one per connection. */
  static final class ReplyDecoder {
    private byte[] buf = new byte[4096];
    private int len;

    List<Reply> feed(byte[] data, int off, int n) throws ProtocolViolation {
      List<Reply> out = new ArrayList<>(2);
      int scanFrom = len;
      append(data, off, n);
      int start = 0;
      for (int k = scanFrom; k < len; k++) {
        if (buf[k] != '\n') continue;
        int end = k;
        if (end > start && buf[end - 1] == '\r') end--;
        if (end > start) out.add(decode(new String(buf, start, end - start, StandardCharsets.UTF_8)));
        start = k + 1;
      }
      System.arraycopy(buf, start, buf, 0, len - start);
      len -= start;
      if (len > MAX_REPLY_BYTES) {
        throw new ProtocolViolation("a reply line exceeds " + MAX_REPLY_BYTES + " bytes");
      }
      return out;
    }

    private void append(byte[] data, int off, int n) {
      if (len + n > buf.length) buf = Arrays.copyOf(buf, Math.max(buf.length * 2, len + n));
      System.arraycopy(data, off, buf, len, n);
      len += n;
    }
  }

  static Reply decode(String line) throws ProtocolViolation {
    Object parsed;
    try {
      parsed = Json.parse(line);
    } catch (Json.Malformed e) {
      throw new ProtocolViolation("malformed reply (" + e.getMessage() + "): " + clip(line));
    }
    if (!(parsed instanceof Map)) throw new ProtocolViolation("a reply must be an object: " + clip(line));
    Map<?, ?> m = (Map<?, ?>) parsed;
    Object ok = m.get("ok");
    if (!(ok instanceof Boolean)) throw new ProtocolViolation("a reply needs a boolean \"ok\": " + clip(line));
    Object id = m.get("id");
    if (id == Json.NULL) id = null;
    if (id != null && !(id instanceof Long) && !(id instanceof String)) {
      throw new ProtocolViolation("a reply's \"id\" must be an integer, a string or null: " + clip(line));
    }
    if ((Boolean) ok) return new Reply(id, true, null, null);
    Object error = m.get("error");
    if (!(error instanceof Map)) throw new ProtocolViolation("an error reply needs an \"error\" object: " + clip(line));
    Object code = ((Map<?, ?>) error).get("code");
    Object message = ((Map<?, ?>) error).get("message");
    if (!(code instanceof String)) throw new ProtocolViolation("an error reply needs a string \"code\": " + clip(line));
    return new Reply(id, false, (String) code, message instanceof String ? (String) message : "");
  }

  static String clip(String text) {
    return text.length() <= 200 ? text : text.substring(0, 200) + "…";
  }
}
