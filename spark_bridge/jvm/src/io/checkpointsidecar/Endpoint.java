package io.checkpointsidecar;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.io.InputStream;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.net.InetSocketAddress;
import java.net.ProtocolFamily;
import java.net.SocketAddress;
import java.net.StandardProtocolFamily;
import java.nio.channels.SocketChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.AccessDeniedException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Paths;
import java.util.Arrays;
import java.util.Map;

/**
 * Where the daemon is, and how to open a channel to it: a Unix domain socket where the JVM has
 * them (Java 16+), loopback TCP otherwise. The bytecode targets Java 8, so the Java 16 API is
 * reached by reflection, once.
 *
 * <p>The TCP listener wants a token first ({@code {"op":"auth","token":…}}). The daemon publishes
 * it, with its port, in the endpoint file beside its socket ({@code <socketPath>.tcp}, readable
 * by those who may connect to the socket; {@code sidecar/wire/endpoint.py} is the reference, a
 * conformance test compares). The file is read at every connect: a daemon restarted since (a new
 * port, a new token) is found again, and a crashed daemon's stale file only makes the connect
 * fail and the sender retry with backoff.
 */
final class Endpoint {
  private Endpoint() { }

  /** The endpoint file's name is the socket's with this suffix ({@code endpoint.SUFFIX}). */
  static final String FILE_SUFFIX = ".tcp";
  /** The endpoint file's format ({@code endpoint.VERSION}). */
  static final long FILE_VERSION = 1;
  /** Largest endpoint file read ({@code endpoint.MAX_FILE_BYTES}). */
  static final int MAX_FILE_BYTES = 4096;

  private static final Method UNIX_ADDRESS_OF; // UnixDomainSocketAddress.of(String), Java 16+
  private static final Method OPEN_WITH_FAMILY; // SocketChannel.open(ProtocolFamily), Java 15+
  private static final ProtocolFamily UNIX;

  static {
    Method of = null;
    Method open = null;
    ProtocolFamily unix = null;
    try {
      of = Class.forName("java.net.UnixDomainSocketAddress").getMethod("of", String.class);
      open = SocketChannel.class.getMethod("open", ProtocolFamily.class);
      unix = StandardProtocolFamily.valueOf("UNIX");
    } catch (ReflectiveOperationException | IllegalArgumentException e) {
      of = null; // Java < 16: loopback TCP only
    }
    UNIX_ADDRESS_OF = of;
    OPEN_WITH_FAMILY = open;
    UNIX = unix;
  }

  static boolean unixSupported() {
    return UNIX_ADDRESS_OF != null;
  }

  /** The endpoint file of the daemon serving {@code socketPath}. */
  static String fileFor(String socketPath) {
    return socketPath + FILE_SUFFIX;
  }

  /**
   * Where the sender connects: the Unix socket, or loopback TCP with the port given or the one
   * the endpoint file names; the token always comes from the endpoint file. One sender per
   * route ({@link #toString()}) is shared by every listener in the JVM.
   */
  static final class Route {
    final boolean unix;
    final String socketPath;
    final String host; // TCP with a port given
    final int port; // TCP: 0 reads it from the endpoint file

    private Route(boolean unix, String socketPath, String host, int port) {
      this.unix = unix;
      this.socketPath = socketPath;
      this.host = host;
      this.port = port;
    }

    static Route unix(String socketPath) {
      return new Route(true, socketPath, null, 0);
    }

    static Route tcp(String socketPath, String host, int port) {
      return new Route(false, socketPath, host, port);
    }

    String endpointFile() {
      return fileFor(socketPath);
    }

    /** {@code unix:/path}, {@code tcp:host:port}, or {@code tcp:/path.tcp} (port from the file). */
    @Override public String toString() {
      if (unix) return "unix:" + socketPath;
      return port > 0 ? "tcp:" + host + ":" + port : "tcp:" + endpointFile();
    }
  }

  /** A new, unconnected channel, the address to connect it to, and the token to send first. */
  static final class Target {
    final SocketChannel channel;
    final SocketAddress address;
    /** Null: none (the Unix socket). */
    final String token;

    Target(SocketChannel channel, SocketAddress address, String token) {
      this.channel = channel;
      this.address = address;
      this.token = token;
    }
  }

  /** What an endpoint file says. */
  static final class Published {
    final String host;
    final int port;
    final String token;

    Published(String host, int port, String token) {
      this.host = host;
      this.port = port;
      this.token = token;
    }
  }

  /**
   * @throws IOException the channel cannot be opened, or (TCP) the endpoint file cannot be read;
   *     the message says what to do
   */
  static Target open(Route route) throws IOException {
    if (route.unix) {
      if (!unixSupported()) {
        throw new IOException(
            "this JVM (Java " + System.getProperty("java.specification.version")
                + ") has no Unix domain sockets (Java 16+); use spark.checkpointSidecar.transport=auto "
                + "or tcp (loopback TCP, with the daemon's endpoint file " + route.endpointFile() + ")");
      }
      try {
        SocketAddress address = (SocketAddress) UNIX_ADDRESS_OF.invoke(null, route.socketPath);
        SocketChannel channel = (SocketChannel) OPEN_WITH_FAMILY.invoke(null, UNIX);
        return new Target(channel, address, null);
      } catch (InvocationTargetException e) {
        Throwable cause = e.getCause();
        if (cause instanceof IOException) throw (IOException) cause;
        throw new IOException("cannot open a Unix socket: " + cause, cause);
      } catch (IllegalAccessException e) {
        throw new IOException("cannot open a Unix socket: " + e, e);
      }
    }
    Published published = read(route.endpointFile());
    String host = route.port > 0 ? route.host : published.host;
    int port = route.port > 0 ? route.port : published.port;
    SocketChannel channel = SocketChannel.open();
    channel.socket().setTcpNoDelay(true);
    return new Target(channel, new InetSocketAddress(host, port), published.token);
  }

  /**
   * Read an endpoint file.
   *
   * @throws IOException it is missing, unreadable or not an endpoint file (the message says which)
   */
  static Published read(String file) throws IOException {
    byte[] data;
    try (InputStream in = Files.newInputStream(Paths.get(file))) {
      data = new byte[MAX_FILE_BYTES + 1];
      int n = 0;
      int k;
      while (n < data.length && (k = in.read(data, n, data.length - n)) > 0) n += k;
      if (n > MAX_FILE_BYTES) throw new IOException(file + " is larger than an endpoint file");
      data = Arrays.copyOf(data, n);
    } catch (NoSuchFileException | FileNotFoundException e) {
      throw new IOException("no endpoint file " + file + " yet (the daemon writes its TCP port and "
          + "token there once it listens; the driver must see the socket's directory)");
    } catch (AccessDeniedException e) {
      throw new IOException("cannot read the endpoint file " + file + ": permission denied (it is "
          + "readable by those who may connect to the socket: the socket's owner and, with "
          + "SIDECAR_SOCKET_MODE=660, its group)");
    }
    Object parsed;
    try {
      parsed = Json.parse(new String(data, StandardCharsets.UTF_8).trim());
    } catch (Json.Malformed e) {
      throw new IOException(file + " is not an endpoint file (" + e.getMessage() + ")");
    }
    if (!(parsed instanceof Map)) throw new IOException(file + " is not an endpoint file");
    Map<?, ?> m = (Map<?, ?>) parsed;
    Object version = m.get("version");
    Object host = m.get("host");
    Object port = m.get("port");
    Object token = m.get("token");
    if (!(version instanceof Long) || (Long) version != FILE_VERSION) {
      throw new IOException(file + " is not a version " + FILE_VERSION + " endpoint file");
    }
    if (!(host instanceof String) || ((String) host).isEmpty()
        || !(port instanceof Long) || (Long) port < 1 || (Long) port > 65535
        || !(token instanceof String) || ((String) token).isEmpty()) {
      throw new IOException(file + " lacks a host, a port or a token");
    }
    return new Published((String) host, (int) (long) (Long) port, (String) token);
  }
}
