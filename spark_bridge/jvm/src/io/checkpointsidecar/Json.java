package io.checkpointsidecar;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * A small strict JSON reader and string quoter, enough for the daemon's reply lines.
 *
 * <p>The listener must not depend on anything beyond the JDK and Spark, and the JSON libraries
 * on a Spark driver's classpath differ between Spark versions; replies are tiny flat objects, so
 * a strict recursive-descent reader with a depth cap is the simpler and safer choice. Values map
 * to {@link Map}, {@link List}, {@link String}, {@link Long} (integers), {@link Double}, {@link
 * Boolean} and {@link #NULL}.
 */
final class Json {
  /** JSON null (a Java null would be ambiguous in maps). */
  static final Object NULL = new Object() {
    @Override public String toString() { return "null"; }
  };

  /** Replies nest two levels; anything much deeper is not a reply of ours. */
  private static final int MAX_DEPTH = 32;

  static final class Malformed extends Exception {
    private static final long serialVersionUID = 1L;
    Malformed(String message) { super(message); }
  }

  private final String s;
  private int i;

  private Json(String s) { this.s = s; }

  static Object parse(String text) throws Malformed {
    Json p = new Json(text);
    p.ws();
    Object v = p.value(0);
    p.ws();
    if (p.i != text.length()) throw p.error("trailing data");
    return v;
  }

  /** {@code text} as a JSON string literal, quotes included. */
  static String quote(String text) {
    StringBuilder b = new StringBuilder(text.length() + 2).append('"');
    for (int k = 0; k < text.length(); k++) {
      char c = text.charAt(k);
      switch (c) {
        case '"': b.append("\\\""); break;
        case '\\': b.append("\\\\"); break;
        case '\n': b.append("\\n"); break;
        case '\r': b.append("\\r"); break;
        case '\t': b.append("\\t"); break;
        default:
          if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
          else b.append(c);
      }
    }
    return b.append('"').toString();
  }

  private Malformed error(String what) {
    return new Malformed(what + " at character " + i);
  }

  private void ws() {
    while (i < s.length()) {
      char c = s.charAt(i);
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
      i++;
    }
  }

  private Object value(int depth) throws Malformed {
    if (depth > MAX_DEPTH) throw error("nested deeper than " + MAX_DEPTH);
    if (i >= s.length()) throw error("unexpected end");
    char c = s.charAt(i);
    switch (c) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return string();
      case 't': return literal("true", Boolean.TRUE);
      case 'f': return literal("false", Boolean.FALSE);
      case 'n': return literal("null", NULL);
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number();
        throw error("unexpected character '" + c + "'");
    }
  }

  private Object literal(String word, Object v) throws Malformed {
    if (!s.startsWith(word, i)) throw error("expected " + word);
    i += word.length();
    return v;
  }

  private Map<String, Object> object(int depth) throws Malformed {
    Map<String, Object> m = new HashMap<>();
    i++;
    ws();
    if (i < s.length() && s.charAt(i) == '}') { i++; return m; }
    while (true) {
      ws();
      if (i >= s.length() || s.charAt(i) != '"') throw error("expected a key");
      String key = string();
      ws();
      if (i >= s.length() || s.charAt(i) != ':') throw error("expected ':'");
      i++;
      ws();
      m.put(key, value(depth + 1));
      ws();
      if (i >= s.length()) throw error("unexpected end");
      char c = s.charAt(i++);
      if (c == '}') return m;
      if (c != ',') throw error("expected ',' or '}'");
    }
  }

  private List<Object> array(int depth) throws Malformed {
    List<Object> l = new ArrayList<>();
    i++;
    ws();
    if (i < s.length() && s.charAt(i) == ']') { i++; return l; }
    while (true) {
      ws();
      l.add(value(depth + 1));
      ws();
      if (i >= s.length()) throw error("unexpected end");
      char c = s.charAt(i++);
      if (c == ']') return l;
      if (c != ',') throw error("expected ',' or ']'");
    }
  }

  private String string() throws Malformed {
    StringBuilder b = new StringBuilder();
    i++; // opening quote
    while (i < s.length()) {
      char c = s.charAt(i++);
      if (c == '"') return b.toString();
      if (c < 0x20) throw error("control character in a string");
      if (c != '\\') { b.append(c); continue; }
      if (i >= s.length()) break;
      char e = s.charAt(i++);
      switch (e) {
        case '"': case '\\': case '/': b.append(e); break;
        case 'b': b.append('\b'); break;
        case 'f': b.append('\f'); break;
        case 'n': b.append('\n'); break;
        case 'r': b.append('\r'); break;
        case 't': b.append('\t'); break;
        case 'u':
          if (i + 4 > s.length()) throw error("short \\u escape");
          try {
            b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
          } catch (NumberFormatException ex) {
            throw error("bad \\u escape");
          }
          i += 4;
          break;
        default: throw error("bad escape");
      }
    }
    throw error("unterminated string");
  }

  private Object number() throws Malformed {
    int start = i;
    if (s.charAt(i) == '-') i++;
    boolean integral = true;
    while (i < s.length()) {
      char c = s.charAt(i);
      if (c >= '0' && c <= '9') { i++; continue; }
      if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') { integral = false; i++; continue; }
      break;
    }
    String text = s.substring(start, i);
    try {
      return integral ? (Object) Long.valueOf(text) : (Object) Double.valueOf(text);
    } catch (NumberFormatException ex) {
      try {
        return Double.valueOf(text); // an integer beyond a long
      } catch (NumberFormatException again) {
        throw error("bad number '" + text + "'");
      }
    }
  }
}
