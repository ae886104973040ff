//! What an answer says about its usage: the engine's reported `prompt_tokens` and
//! `cached_tokens` (vLLM's `prompt_tokens_details`), found in a whole body or in the last
//! bytes of a stream, for the metrics.
//!
//! O(tail bytes) per answer; stateless apart from a [`Tail`] of one stream.

use std::sync::atomic::Ordering;

use super::stats::BackendStats;

const TAIL: usize = 2048;

/// Count the usage numbers of an answer (`data`: its body, or a stream's tail).
pub(super) fn usage(bs: &BackendStats, data: &[u8]) {
    let Some(at) = find(data, "\"usage\"", true) else { return };
    let data = &data[at..];
    if let Some(n) = last_number(data, "\"cached_tokens\"") {
        bs.reported.fetch_add(n, Ordering::Relaxed);
    }
    if let Some(n) = last_number(data, "\"prompt_tokens\"") {
        bs.prompt.fetch_add(n, Ordering::Relaxed);
    }
}

/// The last bytes of a stream (where its usage is).
#[derive(Default)]
pub(super) struct Tail(Vec<u8>);

impl Tail {
    /// The last bytes so far (at least the last 2 KiB).
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether the stream's last event is `data: [DONE]`: the engine has finished the
    /// request, whatever happens to the bytes after it.
    pub fn ended(&self) -> bool {
        let end = self.0.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        self.0[..end].ends_with(b"data: [DONE]") || self.0[..end].ends_with(b"data:[DONE]")
    }

    pub fn push(&mut self, data: &[u8]) {
        self.0.extend_from_slice(data);
        if self.0.len() > 2 * TAIL {
            self.0.drain(..self.0.len() - TAIL);
        }
    }
}

/// Where `key` is in `data`, the last place (`last`) or the first: std's substring search on
/// the text (a stream's tail may begin inside a character: it is skipped), a byte-wise one
/// where `data` is not UTF-8.
pub(super) fn find(data: &[u8], key: &str, last: bool) -> Option<usize> {
    let skip = data.iter().take(3).take_while(|&&b| b & 0xC0 == 0x80).count();
    match std::str::from_utf8(&data[skip..]) {
        Ok(text) if last => text.rfind(key).map(|at| at + skip),
        Ok(text) => text.find(key).map(|at| at + skip),
        Err(_) if last => data.windows(key.len()).rposition(|w| w == key.as_bytes()),
        Err(_) => data.windows(key.len()).position(|w| w == key.as_bytes()),
    }
}

/// The number of the last `key : digits` in `data` (JSON whitespace allowed around `:`).
fn last_number(data: &[u8], key: &str) -> Option<u64> {
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let mut end = data.len();
    while let Some(at) = find(&data[..end], key, true) {
        end = at;
        let rest = &data[at + key.len()..];
        let start = rest.iter().position(|b| !ws(b)).unwrap_or(rest.len());
        let Some(rest) = rest[start..].strip_prefix(b":") else { continue };
        let start = rest.iter().position(|b| !ws(b)).unwrap_or(rest.len());
        let digits = rest[start..].iter().take_while(|b| b.is_ascii_digit()).count();
        if let Ok(n) = std::str::from_utf8(&rest[start..start + digits]).unwrap_or("").parse() {
            return Some(n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{find, last_number, Tail};

    #[test]
    fn usage_numbers_are_the_last_ones() {
        let data = br#"{"usage":{"prompt_tokens": 12,"prompt_tokens_details":{"cached_tokens" : 8}}} {"cached_tokens":9}"#;
        assert_eq!(last_number(data, r#""cached_tokens""#), Some(9));
        assert_eq!(last_number(data, r#""prompt_tokens""#), Some(12));
        assert_eq!(last_number(b"\"cached_tokens\": x", r#""cached_tokens""#), None);
        // A tail cut inside a character, and bytes that are not UTF-8, are searched too.
        let cut = "é\"cached_tokens\": 3".as_bytes();
        assert_eq!(last_number(&cut[1..], r#""cached_tokens""#), Some(3));
        let junk = b"\xff\"cached_tokens\": 4 \xff";
        assert_eq!(last_number(junk, r#""cached_tokens""#), Some(4));
        assert_eq!(find(b"ab ab", "ab", true), Some(3));
        assert_eq!(find(b"ab ab", "ab", false), Some(0));
    }

    #[test]
    fn a_stream_ends_at_its_done_event() {
        let mut tail = Tail::default();
        tail.push(b"data: {\"x\":1}\n\n");
        assert!(!tail.ended());
        tail.push(b"data: [DONE]");
        assert!(tail.ended());
        tail.push(b"\n\n");
        assert!(tail.ended());
        tail.push(b"data: {}\n\n");
        assert!(!tail.ended());
    }
}
