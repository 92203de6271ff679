package io.checkpointsidecar;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * Test-only driver of the listener's Sender, without Spark: the conformance tests
 * (tests/integration/test_listener_conformance.py) run it as a child process and speak to it line by line.
 *
 * <p>Arguments: settings as {@code key=value} (keys of {@link Settings}, no prefix). Commands on
 * stdin, one reply line each on stdout: {@code offer QUERY JSON} → {@code ok}; {@code flush MS},
 * {@code await QUERY MS}, {@code close MS} → {@code true|false}; {@code stats} → the stats JSON;
 * {@code retriable}, {@code closing} → those error codes, sorted, comma-separated; {@code
 * authframe TOKEN} → the auth request line; {@code endpointfile SOCKET} → the endpoint file's
 * path; {@code route} → where the sender connects.
 *
 * <p>For the shared registry ({@link Sender#acquire}): {@code acquire} adds a user of the same
 * sender → {@code ok}; {@code release-async MS} starts a thread that releases one user (flushing
 * within MS) and answers {@code releasing} once that thread waits in the flush; {@code
 * acquire-other PATH} acquires a sender for another Unix socket (and releases it at once) →
 * {@code acquired}.
 */
final class SenderHarness {
  public static void main(String[] args) throws Exception {
    Map<String, String> conf = new HashMap<>();
    for (String arg : args) {
      int eq = arg.indexOf('=');
      conf.put(arg.substring(0, eq), arg.substring(eq + 1));
    }
    final Settings settings = new Settings(conf, System.getenv());
    final Sender sender = Sender.acquire(settings);
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    String line;
    while ((line = in.readLine()) != null) {
      String[] w = line.split(" ", 3);
      switch (w[0]) {
        case "offer":
          final String json = w[2];
          sender.offer(w[1], () -> json);
          reply("ok");
          break;
        case "flush":
          reply(String.valueOf(sender.flush(Long.parseLong(w[1]))));
          break;
        case "await":
          reply(String.valueOf(sender.awaitQuery(w[1], Long.parseLong(w[2]))));
          break;
        case "stats":
          reply(sender.stats().json());
          break;
        case "retriable":
          reply(sorted(Wire.RETRIABLE));
          break;
        case "closing":
          reply(sorted(Wire.CLOSING));
          break;
        case "authframe":
          reply(new String(Wire.authRequest(w[1]), StandardCharsets.UTF_8).trim());
          break;
        case "endpointfile":
          reply(Endpoint.fileFor(w[1]));
          break;
        case "route":
          reply(settings.route().toString());
          break;
        case "acquire":
          Sender.acquire(settings);
          reply("ok");
          break;
        case "release-async":
          final long ms = Long.parseLong(w[1]);
          Thread releasing = new Thread(() -> sender.release(ms), "harness-release");
          releasing.setDaemon(true);
          releasing.start();
          // Answer once the release is inside its flush (waiting on the slots' monitor), so that
          // the next command runs while that flush is under way.
          while (releasing.getState() != Thread.State.TIMED_WAITING && releasing.isAlive()) {
            Thread.sleep(1);
          }
          reply("releasing");
          break;
        case "acquire-other":
          Map<String, String> other = new HashMap<>(conf);
          other.put("socketPath", w[1]);
          Sender.acquire(new Settings(other, System.getenv())).release(0);
          reply("acquired");
          break;
        case "close":
          reply(String.valueOf(sender.release(Long.parseLong(w[1]))));
          return;
        default:
          reply("unknown command " + w[0]);
      }
    }
  }

  private static String sorted(java.util.Set<String> codes) {
    List<String> list = new ArrayList<>(codes);
    Collections.sort(list);
    return String.join(",", list);
  }

  private static void reply(String text) {
    System.out.println(text);
    System.out.flush();
  }
}
