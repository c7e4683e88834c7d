//! The quick way through the usual increments message: an array of flat objects
//! (or one such object; `segments` an object of strings) whose strings hold no
//! escapes and whose numbers are plain integers, read by a scanner that borrows
//! every name from the payload.
//!
//! It answers only where it reads exactly what serde_json reads. Anything else — an
//! escape or control byte in a string, `null`, a number with a fraction, an exponent,
//! a leading zero, `-0` or more than 18 digits, whitespace JSON does not allow, a
//! repeated, unknown or missing field, invalid UTF-8 or JSON — gives `None`, and the
//! message takes the general way ([`super::parse_increments`]), which then decides.
//! A property test holds the two ways to the same answers.

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::RawIncrement;

/// The elements of `payload` when it is an array of plain increment objects, in
/// order; `None` when the general way has to read it.
pub(super) fn plain_increments(payload: &[u8]) -> Option<Vec<RawIncrement<'_>>> {
    let mut scanner = Scanner { text: std::str::from_utf8(payload).ok()?, pos: 0 };
    scanner.expect(b'[')?;
    let mut elements = Vec::new();
    if scanner.peek()? == b']' {
        scanner.pos += 1;
    } else {
        loop {
            elements.push(scanner.object()?);
            match scanner.next_byte()? {
                b',' => {}
                b']' => break,
                _ => return None,
            }
        }
    }
    scanner.skip_whitespace();
    (scanner.pos == payload.len()).then_some(elements)
}

/// `payload` when it is one plain increment object; `None` when the general way
/// has to read it.
pub(super) fn plain_increment(payload: &[u8]) -> Option<RawIncrement<'_>> {
    let mut scanner = Scanner { text: std::str::from_utf8(payload).ok()?, pos: 0 };
    let element = scanner.object()?;
    scanner.skip_whitespace();
    (scanner.pos == payload.len()).then_some(element)
}

struct Scanner<'a> {
    /// Valid UTF-8, so a slice between two ASCII bytes is a `str`.
    text: &'a str,
    pos: usize,
}

impl<'a> Scanner<'a> {
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// JSON's whitespace only (not form feed, which `u8::is_ascii_whitespace` takes).
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes().get(self.pos) {
            self.pos += 1;
        }
    }

    /// The next byte past whitespace, not consumed.
    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.bytes().get(self.pos).copied()
    }

    /// The next byte past whitespace, consumed.
    fn next_byte(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(byte)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next_byte()? == byte).then_some(())
    }

    /// A string without escapes or control bytes, borrowed.
    fn string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.pos;
        let len = self.bytes()[start..].iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        self.pos = start + len;
        self.expect_here(b'"')?;
        Some(&self.text[start..start + len])
    }

    fn expect_here(&mut self, byte: u8) -> Option<()> {
        (self.bytes().get(self.pos) == Some(&byte)).then(|| self.pos += 1)
    }

    /// An integer of at most 18 digits (so it fits an `i64`), without a leading
    /// zero, fraction or exponent, and not `-0`.
    fn integer(&mut self) -> Option<i64> {
        self.skip_whitespace();
        let negative = self.expect_here(b'-').is_some();
        let digits = &self.bytes()[self.pos..];
        let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
        if len == 0 || len > 18 || (len > 1 && digits[0] == b'0') {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = digits.get(len) {
            return None;
        }
        self.pos += len;
        let value = digits[..len].iter().fold(0i64, |value, digit| value * 10 + i64::from(digit - b'0'));
        match (negative, value) {
            (true, 0) => None,
            (true, value) => Some(-value),
            (false, value) => Some(value),
        }
    }

    /// One object with `entity` and `metric`, and `delta`, `ts`, `id` and
    /// `segments` or not, each at most once.
    fn object(&mut self) -> Option<RawIncrement<'a>> {
        self.expect(b'{')?;
        let (mut entity, mut metric, mut delta, mut ts, mut id) = (None, None, None, None, None);
        let mut segments = None;
        loop {
            let field = self.string()?;
            self.expect(b':')?;
            match field {
                "entity" if entity.is_none() => entity = Some(self.string()?),
                "metric" if metric.is_none() => metric = Some(self.string()?),
                "delta" if delta.is_none() => delta = Some(self.integer()?),
                "ts" if ts.is_none() => ts = Some(self.integer()?),
                "id" if id.is_none() => id = Some(self.string()?),
                "segments" if segments.is_none() => segments = Some(self.segments()?),
                _ => return None,
            }
            match self.next_byte()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
        Some(RawIncrement {
            entity: Cow::Borrowed(entity?),
            metric: Cow::Borrowed(metric?),
            delta,
            ts,
            id: id.map(Cow::Borrowed),
            segments,
        })
    }

    /// An object of strings (`segments`), a repeated name keeping its last value
    /// as serde_json's map does.
    fn segments(&mut self) -> Option<BTreeMap<Cow<'a, str>, Cow<'a, str>>> {
        self.expect(b'{')?;
        let mut segments = BTreeMap::new();
        if self.peek()? == b'}' {
            self.pos += 1;
            return Some(segments);
        }
        loop {
            let name = self.string()?;
            self.expect(b':')?;
            segments.insert(Cow::Borrowed(name), Cow::Borrowed(self.string()?));
            match self.next_byte()? {
                b',' => {}
                b'}' => return Some(segments),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Fields<'a> = (&'a str, &'a str, Option<i64>, Option<i64>, Option<&'a str>);

    fn scanned(payload: &str) -> Option<Vec<Fields<'_>>> {
        let elements = plain_increments(payload.as_bytes())?;
        Some(
            elements
                .into_iter()
                .map(|raw| {
                    let (Cow::Borrowed(entity), Cow::Borrowed(metric)) = (raw.entity, raw.metric) else {
                        panic!("names are borrowed")
                    };
                    let id = raw.id.map(|id| match id {
                        Cow::Borrowed(id) => id,
                        Cow::Owned(_) => panic!("ids are borrowed"),
                    });
                    (entity, metric, raw.delta, raw.ts, id)
                })
                .collect(),
        )
    }

    #[test]
    fn reads_plain_arrays_borrowing_every_name() {
        let payload = " [ {\"entity\":\"user:7\",\"metric\":\"views\"},\r\n\t{\"metric\" : \"v.2\", \"delta\":-12,\"ts\":0,\
                       \"entity\":\"ünï\",\"id\":\"e-1\"}, {\"entity\":\"a\",\"metric\":\"m\",\"delta\":999999999999999999} ] ";
        assert_eq!(
            scanned(payload),
            Some(vec![
                ("user:7", "views", None, None, None),
                ("ünï", "v.2", Some(-12), Some(0), Some("e-1")),
                ("a", "m", Some(999_999_999_999_999_999), None, None),
            ])
        );
        assert_eq!(scanned("[]"), Some(vec![]));
        assert_eq!(scanned(" [ \n] "), Some(vec![]));
    }

    #[test]
    fn reads_a_plain_object_alone() {
        type Owned = (String, String, Option<i64>, Option<i64>, Option<String>);
        fn single(payload: &str) -> Option<Owned> {
            plain_increment(payload.as_bytes()).map(|raw| {
                (raw.entity.into_owned(), raw.metric.into_owned(), raw.delta, raw.ts, raw.id.map(Cow::into_owned))
            })
        }
        let fields = single(" {\"metric\":\"v.2\",\n\"entity\":\"user:7\", \"delta\":-3,\"id\":\"e\",\"ts\":5}\r\n");
        assert_eq!(fields, Some(("user:7".into(), "v.2".into(), Some(-3), Some(5), Some("e".into()))));
        for leave in [
            r#"[{"entity":"a","metric":"v"}]"#,
            r#"{"entity":"a","metric":"v"} x"#,
            r#"{"entity":"a","metric":"v"}{}"#,
            r#"{"entity":"a","metric":"v","colour":1}"#,
            r#"{"entity":"a\u0041","metric":"v"}"#,
            r#"{"entity":"a"}"#,
            "\u{c}{\"entity\":\"a\",\"metric\":\"v\"}",
            "",
        ] {
            assert_eq!(single(leave), None, "{leave}");
        }
    }

    #[test]
    fn leaves_everything_else_to_the_general_way() {
        let element = |fields: &str| format!("[{{\"entity\":\"a\",{fields}}}]");
        let leave = [
            element(r#""metric":"v","delta":null"#),
            element(r#""metric":"v","id":null"#),
            element(r#""metric":"v","delta":1.0"#),
            element(r#""metric":"v","delta":1e3"#),
            element(r#""metric":"v","delta":1E3"#),
            element(r#""metric":"v","delta":-0"#),
            element(r#""metric":"v","delta":01"#),
            element(r#""metric":"v","delta":+1"#),
            element(r#""metric":"v","delta":-"#),
            element(r#""metric":"v","delta":1234567890123456789"#),
            element(r#""metric":"v","delta":"1""#),
            element(r#""metric":"v\u0041""#),
            element(r#""metric":"v\"""#),
            element("\"metric\":\"v\tx\""),
            element(r#""metric":"v","metric":"w""#),
            element(r#""metric":"v","entity":"b""#),
            element(r#""metric":"v","colour":1"#),
            element(r#""metrics":"v""#),
            element(r#""metric":"v","#),
            r#"[{"entity":"a"}]"#.to_string(),
            r#"[{}]"#.to_string(),
            r#"[{"entity":"a","metric":"v"},]"#.to_string(),
            r#"[{"entity":"a","metric":"v"}"#.to_string(),
            r#"[{"entity":"a","metric":"v"}] x"#.to_string(),
            r#"[{"entity":"a","metric":"v"}][]"#.to_string(),
            r#"[{"entity":"a","metric":"v"} {"entity":"a","metric":"v"}]"#.to_string(),
            r#"[{"entity":"a" "metric":"v"}]"#.to_string(),
            r#"[{"entity":"a";"metric":"v"}]"#.to_string(),
            "\u{c}[]".to_string(),
            "[]\u{c}".to_string(),
            r#"[5]"#.to_string(),
            r#"[["a","v"]]"#.to_string(),
            r#"{"entity":"a","metric":"v"}"#.to_string(),
            String::new(),
        ];
        for payload in &leave {
            assert_eq!(scanned(payload), None, "{payload}");
        }
        assert_eq!(plain_increments(b"[{\"entity\":\"\xff\",\"metric\":\"v\"}]").map(|v| v.len()), None);
    }
}
