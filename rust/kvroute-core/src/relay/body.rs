//! Keying a `/v1/completions` body with a token-id prompt in Rust, without the Python hook:
//! the prompt's ids from [`prompt_ids`], the whole body checked to be strict JSON, and the
//! two top-level fields routing reads, `stream` and the session field.
//!
//! It answers only when its answer is the Python keyer's for certain: a body that is valid
//! UTF-8 and strict JSON (no `NaN`, no control characters in strings, nesting below 64),
//! whose `stream` is absent or a boolean, and whose session field, when present, is a
//! string without escapes, an integer that fits 64 bits, or a value of another type (no
//! session). Anything else gives `None` and goes to the hook, which accepts, refuses and
//! reads exactly as the Python keyer (`kvroute.proxy.keys`) does.
//!
//! O(body bytes); stateless and thread-safe.

use crate::keys::block_hashes_u32;
use crate::prompt_scan::prompt_ids;
use crate::Id;

use super::Keyed;

/// Levels of nesting checked, the body's own object included (64 inside it).
const MAX_DEPTH: usize = 65;

/// The routing inputs of a completions `body` (see the module doc); `session_header`: the
/// session header's value, which wins over the body's field.
pub fn token_prompt(
    body: &[u8],
    block_size: usize,
    session_field: Option<&str>,
    session_header: Option<&str>,
) -> Option<Keyed> {
    let prompt = prompt_ids(body)?;
    std::str::from_utf8(body).ok()?;
    let mut j = Json { b: body, pos: 0, depth: 0 };
    let mut stream = false;
    let mut session: Option<Id> = None;
    j.ws();
    if j.b.get(j.pos) != Some(&b'{') {
        return None;
    }
    j.items(&mut |j, key| {
        let (key, escaped) = key?;
        let start = j.pos;
        if start == prompt.start {
            j.pos = prompt.end; // the scan has read the prompt's ids
        } else {
            j.value()?;
        }
        if escaped {
            return None; // which field it names is the parser's business
        }
        let value = &body[start..j.pos];
        if key == b"stream" {
            stream = match value {
                b"true" => true,
                b"false" => false,
                _ => return None,
            };
        } else if session_field.is_some_and(|f| f.as_bytes() == key) {
            session = session_value(value)?;
        }
        Some(())
    })?;
    j.ws();
    if j.pos != body.len() {
        return None;
    }
    if let Some(h) = session_header.filter(|h| !h.is_empty()) {
        session = Some(Id::Str(h.to_owned()));
    }
    keyed(&prompt.ids, block_size, stream, session)
}

/// The routing inputs of a prompt's token `ids`: their block keys and the ids after the last
/// full block; None for a session id the hooks refuse, in their words (over
/// [`MAX_SESSION_ID_BYTES`]).
pub(super) fn keyed(ids: &[u32], block_size: usize, stream: bool, session: Option<Id>) -> Option<Keyed> {
    if matches!(&session, Some(Id::Str(s)) if s.len() > MAX_SESSION_ID_BYTES) {
        return None;
    }
    let keys = block_hashes_u32(ids, block_size);
    let tail = Some(ids[ids.len() - ids.len() % block_size..].to_vec());
    Some(Keyed { keys, input_length: ids.len() as u64, stream, session, tail })
}

/// Longest session id accepted (the Python keyer's `MAX_SESSION_ID_BYTES`).
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// A session field's value: `Some(None)` for no session, `None` when unsure.
fn session_value(value: &[u8]) -> Option<Option<Id>> {
    match value.first()? {
        b'"' => {
            let inner = &value[1..value.len() - 1];
            if inner.contains(&b'\\') {
                return None;
            }
            let s = std::str::from_utf8(inner).ok()?;
            Some((!s.is_empty()).then(|| Id::Str(s.to_owned())))
        }
        b'-' | b'0'..=b'9' => {
            if value.iter().any(|c| matches!(c, b'.' | b'e' | b'E')) {
                return None; // a float: the hooks refuse it
            }
            std::str::from_utf8(value).ok()?.parse::<i64>().ok().map(|i| Some(Id::Int(i)))
        }
        _ => Some(None),
    }
}

/// What reads one item of [`Json::items`]: the reader, and a member's key with whether it
/// holds an escape (None for an array's item).
type Each<'f, 'a> = dyn FnMut(&mut Json<'a>, Option<(&'a [u8], bool)>) -> Option<()> + 'f;

/// A strict JSON reader that only checks and skips.
struct Json<'a> {
    b: &'a [u8],
    pos: usize,
    depth: usize,
}

impl<'a> Json<'a> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn next(&mut self) -> Option<u8> {
        let c = *self.b.get(self.pos)?;
        self.pos += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.pos) == Some(&c)).then(|| self.pos += 1)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.b.get(self.pos..)?.starts_with(word).then(|| self.pos += word.len())
    }

    /// A string: its raw bytes between the quotes and whether it holds an escape.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        self.eat(b'"')?;
        let start = self.pos;
        let mut escaped = false;
        loop {
            match self.next()? {
                b'"' => return Some((&self.b[start..self.pos - 1], escaped)),
                b'\\' => {
                    escaped = true;
                    match self.next()? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            let hex = self.b.get(self.pos..self.pos + 4)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            self.pos += 4;
                        }
                        _ => return None,
                    }
                }
                c if c < 0x20 => return None,
                _ => {}
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while self.b.get(self.pos).is_some_and(u8::is_ascii_digit) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Option<()> {
        let _ = self.eat(b'-');
        if self.eat(b'0').is_none() && self.digits() == 0 {
            return None;
        }
        if self.eat(b'.').is_some() && self.digits() == 0 {
            return None;
        }
        if matches!(self.b.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.b.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// The items of an array or the members of an object (`pos` at its opening bracket),
    /// each read by `each`, which is given a member's key and whether the key holds an
    /// escape (None for an array's items).
    fn items(&mut self, each: &mut Each<'_, 'a>) -> Option<()> {
        let open = self.next()?;
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        let close = if open == b'[' { b']' } else { b'}' };
        self.ws();
        if self.eat(close).is_none() {
            loop {
                self.ws();
                let key = if open == b'{' {
                    let key = self.string()?;
                    self.ws();
                    self.eat(b':')?;
                    self.ws();
                    Some(key)
                } else {
                    None
                };
                each(self, key)?;
                self.ws();
                match self.next()? {
                    b',' => {}
                    c if c == close => break,
                    _ => return None,
                }
            }
        }
        self.depth -= 1;
        Some(())
    }

    /// Check and skip one value (`pos` at its first byte).
    fn value(&mut self) -> Option<()> {
        match *self.b.get(self.pos)? {
            b'"' => self.string().map(|_| ()),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            b'[' | b'{' => self.items(&mut |j, _| j.value()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{token_prompt, MAX_SESSION_ID_BYTES};
    use crate::Id;

    fn key(body: &str, header: Option<&str>) -> Option<(u64, bool, Option<Id>)> {
        token_prompt(body.as_bytes(), 2, Some("session_id"), header)
            .map(|k| (k.input_length, k.stream, k.session))
    }

    #[test]
    fn reads_what_routing_needs() {
        let s = |v: &str| Some(Id::Str(v.into()));
        assert_eq!(
            key(r#"{"prompt": [1, 2, 3], "stream": true, "session_id": "a"}"#, None),
            Some((3, true, s("a")))
        );
        assert_eq!(
            key(r#"{"prompt":[1],"session_id":-7,"x":{"y":[1.5e-3,null,"\u00e9"]}}"#, None),
            Some((1, false, Some(Id::Int(-7))))
        );
        assert_eq!(key(r#"{"prompt":[1],"session_id":"a"}"#, Some("h")), Some((1, false, s("h"))));
        assert_eq!(key(r#"{"prompt":[1],"session_id":""}"#, Some("")), Some((1, false, None)));
        assert_eq!(key(r#"{"session_id":"a","session_id":null,"prompt":[1]}"#, None), Some((1, false, None)));
    }

    /// Session ids the hooks refuse: a float, a number beyond 64 bits, a string too long.
    #[test]
    fn doubtful_sessions_go_to_the_hook() {
        let long = format!(r#"{{"prompt":[1],"session_id":"{}"}}"#, "s".repeat(MAX_SESSION_ID_BYTES + 1));
        for body in [
            r#"{"prompt":[1],"session_id":2.0}"#,
            r#"{"prompt":[1],"session_id":1180591620717411303424}"#,
            &long,
        ] {
            assert_eq!(key(body, None), None, "{body}");
        }
        assert_eq!(key(r#"{"prompt":[1]}"#, Some(&"h".repeat(MAX_SESSION_ID_BYTES + 1))), None);
    }

    #[test]
    fn leaves_doubtful_bodies_to_the_hook() {
        for body in [
            r#"{"prompt": [1], "stream": 1}"#,
            r#"{"prompt": [1], "stream": "yes"}"#,
            r#"{"prompt": [1], "x": NaN}"#,
            r#"{"prompt": [1], "x": 01}"#,
            r#"{"prompt": [1], "x": 1.}"#,
            r#"{"prompt": [1], "x": "a\qb"}"#,
            "{\"prompt\": [1], \"x\": \"a\tb\"}",
            r#"{"prompt": [1], "x": [1,]}"#,
            r#"{"prompt": [1], "x": {"a" 1}}"#,
            r#"{"prompt": [1], "session_id": "a\"b"}"#,
            r#"{"prompt": [1], "session_id": 99999999999999999999}"#,
            r#"{"prompt": [1], "str\u0065am": true}"#,
            r#"{"prompt": [1]} {}"#,
            r#"{"prompt": "text"}"#,
        ] {
            assert_eq!(key(body, None), None, "{body}");
        }
        let nested = |n: usize| format!(r#"{{"prompt": [1], "x": {}{}}}"#, "[".repeat(n), "]".repeat(n));
        assert_eq!(key(&nested(65), None), None);
        assert_eq!(key(&nested(64), None), Some((1, false, None)));
    }
}
