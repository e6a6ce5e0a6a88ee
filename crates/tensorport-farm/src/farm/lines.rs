//! Reading a producer's result lines: a whole line the farm can read, the torn end of a
//! producer's output (killed mid-write: its input is redone), or a whole line the farm cannot
//! read, which is an error for the input it names, never a reason to kill the producer.

use crate::record::ResultLine;

/// What one line of a producer's output is.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Line {
    /// A result the farm can read.
    Result(ResultLine),
    /// The last bytes of an output that ended without a newline: a line cut by a kill.
    Torn,
    /// A whole line that is not a result line; `index` is the input it names, where it names
    /// one.
    Unreadable { index: Option<u64>, why: String },
}

/// Reads `text`, which ended with a newline if `whole`.
pub(super) fn read(text: &str, whole: bool) -> Line {
    match serde_json::from_str::<ResultLine>(text) {
        Ok(r) => Line::Result(r),
        Err(_) if !whole => Line::Torn,
        Err(e) => Line::Unreadable {
            index: serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| v.get("index")?.as_u64()),
            why: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_line_and_an_unreadable_one_are_told_apart() {
        let good = r#"{"index":3,"input":"a.jpg","class":1,"scores":[0.5,"NaN","-Infinity"],"latency_ms":1.0,"producer":"p1"}"#;
        let Line::Result(r) = read(good, true) else {
            panic!("not read")
        };
        let s = r.scores.unwrap();
        assert_eq!((s[0], s[2]), (0.5, f32::NEG_INFINITY));
        assert!(s[1].is_nan());
        // The same line cut short by a kill.
        assert_eq!(read(&good[..40], false), Line::Torn);
        // Whole, but a null score (what a writer without the string form makes of NaN).
        let null = good.replace("\"NaN\"", "null");
        match read(&null, true) {
            Line::Unreadable {
                index: Some(3),
                why,
            } => assert!(why.contains("null"), "{why}"),
            other => panic!("{other:?}"),
        }
        // Whole and not JSON at all: no input named.
        assert!(matches!(
            read("panicked at src/x.rs", true),
            Line::Unreadable { index: None, .. }
        ));
        // A cut line that happens to parse is a result all the same.
        assert!(matches!(read(good, false), Line::Result(_)));
    }
}
