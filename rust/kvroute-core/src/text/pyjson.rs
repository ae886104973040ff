//! What Python writes where chat templates call into it: `json.dumps` (transformers' `tojson`
//! filter) and `datetime.strftime` of the current time (`strftime_now`), in UTC.
//!
//! Pure functions; O(output).

use std::fmt::Write;

use serde_json::Value;

/// `json.dumps`'s options as `tojson` passes them.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Spaces per level; None: everything on one line.
    pub indent: Option<usize>,
    /// (item separator, key separator); default `(", ", ": ")`, or `(",", ": ")` with an
    /// indent.
    pub separators: Option<(String, String)>,
    /// Object keys in sorted order (else as given).
    pub sort_keys: bool,
    /// Non-ASCII characters as `\uXXXX` escapes.
    pub ensure_ascii: bool,
}

/// `json.dumps(value, ...)` (see [`Options`]).
pub fn dumps(value: &Value, options: &Options) -> String {
    let (item, key) = match &options.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    write(&mut out, value, options, (item, key), 0);
    out
}

fn newline(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write(out: &mut String, value: &Value, o: &Options, seps: (&str, &str), level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let _ = write!(out, "{n}");
        }
        Value::String(s) => string(out, s, o.ensure_ascii),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(seps.0);
                }
                newline(out, o.indent, level + 1);
                write(out, v, o, seps, level + 1);
            }
            newline(out, o.indent, level);
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(seps.0);
                }
                newline(out, o.indent, level + 1);
                string(out, k, o.ensure_ascii);
                out.push_str(seps.1);
                write(out, v, o, seps, level + 1);
            }
            newline(out, o.indent, level);
            out.push('}');
        }
    }
}

/// A JSON string as Python's encoder writes it.
fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// `(year, month 1-12, day 1-31)` of a day counted from 1970-01-01 (Howard Hinnant's
/// civil-from-days).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Days from 1970-01-01 to January 1st of `year` (the inverse of [`civil`] there).
fn days_from_civil(year: i64) -> i64 {
    let y = year - 1; // January counts in the year before, in a March-based year
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doe = 365 * yoe + yoe / 4 - yoe / 100 + 306; // March 1st + 306 days = January 1st
    era * 146_097 + doe - 719_468
}

/// `time.strftime(format)` at `secs` since the epoch, UTC: `%Y %y %m %d %e %B %b %A %a %j
/// %H %I %M %S %p %%`; other directives are kept as written.
pub fn strftime(secs: u64, format: &str) -> String {
    let secs = i64::try_from(secs).unwrap_or(i64::MAX);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil(days);
    let (hour, minute, second) = (rest / 3600, rest / 60 % 60, rest % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('j') => write!(out, "{yday:03}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{:02}", (hour + 11) % 12 + 1),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}
