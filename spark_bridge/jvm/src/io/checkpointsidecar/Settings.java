package io.checkpointsidecar;

import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Locale;
import java.util.Map;

/**
 * The listener's settings, from Spark conf ({@code spark.checkpointSidecar.*}), then the
 * driver's environment, then defaults. Validated once, at construction: a bad value is a
 * configuration error that should stop the application from starting, not a silent loss of
 * checkpoints later.
 */
final class Settings {
  static final String PREFIX = "spark.checkpointSidecar.";
  static final String DEFAULT_SOCKET_PATH = "/tmp/checkpoint-sidecar.sock";

  /** Every key (without the prefix), its environment variable (or null), its default. */
  static final Map<String, String[]> KEYS;

  static {
    Map<String, String[]> k = new LinkedHashMap<>();
    k.put("socketPath", new String[] {"SIDECAR_SOCKET_PATH", DEFAULT_SOCKET_PATH});
    k.put("tcpPort", new String[] {"SIDECAR_TCP_PORT", "0"});
    k.put("tcpHost", new String[] {"SIDECAR_TCP_HOST", "127.0.0.1"});
    k.put("transport", new String[] {null, "auto"});
    k.put("connectTimeoutMs", new String[] {null, "5000"});
    // Above the daemon's SIDECAR_BLOB_ACK_TIMEOUT_S (30 s): in blob ack mode a held reply is
    // a busy daemon, not a dead one.
    k.put("replyTimeoutMs", new String[] {null, "60000"});
    k.put("terminateWaitMs", new String[] {null, "2000"});
    k.put("shutdownWaitMs", new String[] {null, "2000"});
    k.put("backoffMinMs", new String[] {null, "50"});
    k.put("backoffMaxMs", new String[] {null, "5000"});
    k.put("maxQueries", new String[] {null, "10000"});
    KEYS = Collections.unmodifiableMap(k);
  }

  enum Transport { AUTO, UNIX, TCP }

  final String socketPath;
  final int tcpPort; // 0: the one the daemon's endpoint file names
  final String tcpHost;
  final Transport transport;
  final long connectTimeoutMs;
  final long replyTimeoutMs;
  final long terminateWaitMs;
  final long shutdownWaitMs;
  final long backoffMinMs;
  final long backoffMaxMs;
  final int maxQueries;

  /**
   * @param conf keys without the prefix (e.g. {@code socketPath}); absent or empty values fall
   *     back to the environment variable, then the default
   * @param env the process environment (a parameter so that tests can pass their own)
   * @throws IllegalArgumentException an unknown key or a bad value; the message names the key
   */
  Settings(Map<String, String> conf, Map<String, String> env) {
    for (String key : conf.keySet()) {
      if (!KEYS.containsKey(key)) {
        throw new IllegalArgumentException(
            "unknown setting " + PREFIX + key + "; known: " + String.join(", ", KEYS.keySet()));
      }
    }
    Map<String, String> v = new LinkedHashMap<>();
    for (Map.Entry<String, String[]> e : KEYS.entrySet()) {
      String value = conf.get(e.getKey());
      String envName = e.getValue()[0];
      if ((value == null || value.isEmpty()) && envName != null) value = env.get(envName);
      if (value == null || value.isEmpty()) value = e.getValue()[1];
      v.put(e.getKey(), value.trim());
    }
    socketPath = v.get("socketPath");
    // "auto", as the daemon's SIDECAR_TCP_PORT says it (a driver may share its environment):
    // the port the daemon's endpoint file names.
    if (v.get("tcpPort").equalsIgnoreCase("auto")) v.put("tcpPort", "0");
    tcpPort = (int) number(v, "tcpPort", 0, 65535);
    tcpHost = v.get("tcpHost");
    if (!tcpHost.equals("127.0.0.1") && !tcpHost.equals("::1") && !tcpHost.equals("localhost")) {
      throw new IllegalArgumentException(
          PREFIX + "tcpHost=" + tcpHost + ": the daemon listens on loopback only; use 127.0.0.1 or ::1");
    }
    try {
      transport = Transport.valueOf(v.get("transport").toUpperCase(Locale.ROOT));
    } catch (IllegalArgumentException e) {
      throw new IllegalArgumentException(
          PREFIX + "transport=" + v.get("transport") + ": use auto, unix or tcp");
    }
    connectTimeoutMs = number(v, "connectTimeoutMs", 1, 3_600_000);
    replyTimeoutMs = number(v, "replyTimeoutMs", 1, 3_600_000);
    terminateWaitMs = number(v, "terminateWaitMs", 0, 3_600_000);
    shutdownWaitMs = number(v, "shutdownWaitMs", 0, 3_600_000);
    backoffMinMs = number(v, "backoffMinMs", 1, 3_600_000);
    backoffMaxMs = number(v, "backoffMaxMs", backoffMinMs, 3_600_000);
    maxQueries = (int) number(v, "maxQueries", 1, 10_000_000);
  }

  private static long number(Map<String, String> v, String key, long min, long max) {
    String text = v.get(key);
    long n;
    try {
      n = Long.parseLong(text);
    } catch (NumberFormatException e) {
      throw new IllegalArgumentException(PREFIX + key + "=" + text + ": not a whole number");
    }
    if (n < min || n > max) {
      throw new IllegalArgumentException(PREFIX + key + "=" + text + ": must be " + min + ".." + max);
    }
    return n;
  }

  /**
   * Where the sender connects: the Unix socket where the JVM has them (or with {@code
   * transport=unix}); else loopback TCP, to {@code tcpPort} when given, else to the port the
   * daemon's endpoint file names ({@code <socketPath>.tcp}), with the token it holds. One sender
   * per route is shared by every listener.
   */
  Endpoint.Route route() {
    boolean unix = transport == Transport.UNIX
        || (transport == Transport.AUTO && Endpoint.unixSupported());
    return unix ? Endpoint.Route.unix(socketPath) : Endpoint.Route.tcp(socketPath, tcpHost, tcpPort);
  }
}
