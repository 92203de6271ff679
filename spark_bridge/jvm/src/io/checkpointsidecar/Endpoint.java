package io.checkpointsidecar;

import java.io.IOException;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.net.InetSocketAddress;
import java.net.ProtocolFamily;
import java.net.SocketAddress;
import java.net.StandardProtocolFamily;
import java.nio.channels.SocketChannel;

/**
 * Opens a channel to the daemon: a Unix domain socket where the JVM has them (Java 16+), loopback
 * TCP otherwise. The bytecode targets Java 8, so the Java 16 API is reached by reflection, once.
 */
final class Endpoint {
  private Endpoint() { }

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

  /** A new, unconnected channel and the address to connect it to. */
  static final class Target {
    final SocketChannel channel;
    final SocketAddress address;

    Target(SocketChannel channel, SocketAddress address) {
      this.channel = channel;
      this.address = address;
    }
  }

  /**
   * @param endpoint {@code unix:/path} or {@code tcp:host:port} (see {@link Settings#endpoint()})
   * @throws IOException the channel cannot be opened; for a Unix socket on an old JVM, the
   *     message says which setting to use instead
   */
  static Target open(String endpoint) throws IOException {
    if (endpoint.startsWith("unix:")) {
      if (!unixSupported()) {
        throw new IOException(
            "this JVM (Java " + System.getProperty("java.specification.version")
                + ") has no Unix domain sockets (Java 16+); set spark.checkpointSidecar.tcpPort "
                + "(or SIDECAR_TCP_PORT) to the daemon's SIDECAR_TCP_PORT");
      }
      try {
        SocketAddress address = (SocketAddress) UNIX_ADDRESS_OF.invoke(null, endpoint.substring(5));
        SocketChannel channel = (SocketChannel) OPEN_WITH_FAMILY.invoke(null, UNIX);
        return new Target(channel, address);
      } catch (InvocationTargetException e) {
        Throwable cause = e.getCause();
        if (cause instanceof IOException) throw (IOException) cause;
        throw new IOException("cannot open a Unix socket: " + cause, cause);
      } catch (IllegalAccessException e) {
        throw new IOException("cannot open a Unix socket: " + e, e);
      }
    }
    String hostPort = endpoint.substring(4);
    int colon = hostPort.lastIndexOf(':');
    InetSocketAddress address =
        new InetSocketAddress(hostPort.substring(0, colon), Integer.parseInt(hostPort.substring(colon + 1)));
    SocketChannel channel = SocketChannel.open();
    channel.socket().setTcpNoDelay(true);
    return new Target(channel, address);
  }
}
