//! Finding the token ids of a completions body's top-level `"prompt"` without parsing the
//! body: one pass over its bytes that skips every other value, so a proxy can key a request
//! of 40k token ids in microseconds and hand the rest of the body (small) to a JSON parser.
//!
//! The scan answers only when the answer is unambiguous: a body that is one JSON object
//! whose keys have no escapes, with exactly one `"prompt"` key at the top level, whose value
//! is a non-empty array of plain decimal integers (no sign, fraction, exponent or leading
//! zero) below 2^32. Anything else gives `None`, and the caller parses the whole body, so the
//! scan never changes what is accepted or refused: it does not validate the other values
//! (their strings' contents, numbers' digits), which the caller's parser of the rest does.
//!
//! O(body bytes); no allocation besides the ids; stateless and thread-safe.

/// The ids of the prompt and the byte range of its array (`body[start..end]` is `[...]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptIds {
    pub ids: Vec<u32>,
    pub start: usize,
    pub end: usize,
}

struct Scan<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Scan<'_> {
    fn ws(&mut self) {
        self.pos = self.b.len() - trim_space(self.b.get(self.pos..).unwrap_or_default()).len();
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.b.get(self.pos) == Some(&c)).then(|| self.pos += 1)
    }

    /// A string at `pos` (its opening quote); the raw bytes between the quotes and whether
    /// they hold an escape.
    fn string(&mut self) -> Option<(&[u8], bool)> {
        self.eat(b'"')?;
        let start = self.pos;
        let mut escaped = false;
        loop {
            match *self.b.get(self.pos)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    self.pos += 2;
                }
                _ => self.pos += 1,
            }
        }
        let raw = self.b.get(start..self.pos)?;
        self.pos += 1;
        Some((raw, escaped))
    }

    /// Skip one value of any kind (nested ones by depth, strings by their quotes).
    fn skip_value(&mut self) -> Option<()> {
        self.ws();
        let mut depth = 0usize;
        loop {
            match *self.b.get(self.pos)? {
                b'"' => {
                    self.string()?;
                }
                b'[' | b'{' => {
                    depth += 1;
                    self.pos += 1;
                }
                b']' | b'}' => {
                    depth = depth.checked_sub(1)?;
                    self.pos += 1;
                }
                b',' | b':' if depth > 0 => self.pos += 1,
                b',' | b':' => return None,
                _ => {
                    // A scalar (number, true, false, null): up to a delimiter.
                    while !matches!(
                        self.b.get(self.pos),
                        None | Some(b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r' | b'"' | b':')
                    ) {
                        self.pos += 1;
                    }
                }
            }
            self.ws();
            if depth == 0 {
                return Some(());
            }
        }
    }

    /// A non-empty array of plain decimal integers below 2^32 (the hot loop: a local slice,
    /// one overflow check per number).
    fn ids(&mut self) -> Option<Vec<u32>> {
        self.eat(b'[')?;
        let mut rest = &self.b[self.pos..];
        let mut ids = Vec::with_capacity(rest.len() / 6);
        loop {
            rest = trim_space(rest);
            let (id, digits) = plain_u32(rest)?;
            ids.push(id);
            rest = trim_space(&rest[digits..]);
            match rest.first()? {
                b',' => rest = &rest[1..],
                b']' => {
                    self.pos = self.b.len() - rest.len() + 1;
                    return Some(ids);
                }
                _ => return None,
            }
        }
    }
}

fn trim_space(mut b: &[u8]) -> &[u8] {
    while let [c, tail @ ..] = b {
        if !is_space(*c) {
            break;
        }
        b = tail;
    }
    b
}

/// A plain decimal integer below 2^32 at the start of `b` (no sign, no leading zero) and its
/// digit count.
#[inline]
fn plain_u32(b: &[u8]) -> Option<(u32, usize)> {
    let mut value: u64 = 0;
    let mut digits = 0;
    for &c in b.iter().take(11) {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        value = value * 10 + u64::from(d);
        digits += 1;
    }
    if digits == 0 || (digits > 1 && b[0] == b'0') {
        return None;
    }
    Some((u32::try_from(value).ok()?, digits))
}

fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// The top-level `"prompt"` ids of a JSON object body, when unambiguous (see the module doc).
pub fn prompt_ids(body: &[u8]) -> Option<PromptIds> {
    let mut s = Scan { b: body, pos: 0 };
    s.eat(b'{')?;
    let mut found = None;
    loop {
        let (key, escaped) = s.string()?;
        if escaped {
            return None;
        }
        let is_prompt = key == b"prompt";
        s.eat(b':')?;
        if is_prompt {
            if found.is_some() {
                return None; // a duplicate key: which one counts is the parser's business
            }
            s.ws();
            let start = s.pos;
            let ids = s.ids()?;
            found = Some(PromptIds { ids, start, end: s.pos });
        } else {
            s.skip_value()?;
        }
        s.ws();
        match *s.b.get(s.pos)? {
            b',' => s.pos += 1,
            b'}' => {
                s.pos += 1;
                s.ws();
                return if s.pos == s.b.len() { found } else { None };
            }
            _ => return None,
        }
        s.ws();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(body: &str) -> Option<Vec<u32>> {
        prompt_ids(body.as_bytes()).map(|p| {
            assert_eq!(&body.as_bytes()[p.start], &b'[');
            assert_eq!(&body.as_bytes()[p.end - 1], &b']');
            p.ids
        })
    }

    #[test]
    fn finds_the_top_level_prompt() {
        assert_eq!(ids(r#"{"prompt": [1, 2, 3], "stream": true}"#), Some(vec![1, 2, 3]));
        assert_eq!(ids(r#"{"model":"m","prompt":[0,4294967295]}"#), Some(vec![0, u32::MAX]));
        let nested = r#" {"a": {"prompt": [9]}, "b": ["prompt", "x\"y", [1, {"c": 2}]],
            "prompt" : [ 7 , 8 ] , "n": -1.5e3, "t": null} "#;
        assert_eq!(ids(nested), Some(vec![7, 8]));
    }

    #[test]
    fn ambiguous_or_unusual_bodies_are_left_to_the_parser() {
        for body in [
            r#"{"prompt": [1], "prompt": [2]}"#,
            r#"{"pro\u006dpt": [1]}"#,
            r#"{"prompt": "text"}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [01]}"#,
            r#"{"prompt": [1.0]}"#,
            r#"{"prompt": [1e3]}"#,
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": [[1, 2]]}"#,
            r#"{"prompt": [1,]}"#,
            r#"{"prompt": [1]} x"#,
            r#"{"prompt": [1]"#,
            r#"[{"prompt": [1]}]"#,
            r#"{"a": 1}"#,
            r#"{}"#,
            r#"{"a" 1, "prompt": [1]}"#,
            r#"{"a": ], "prompt": [1]}"#,
            "",
        ] {
            assert_eq!(ids(body), None, "{body}");
        }
    }
}
