//! How inputs are named in result lines, exactly.

use tensorport_vision::Source;

/// How an input is named in its result line: `input` is the file's path as given, or
/// `synthetic:N`; a file whose path would read as `synthetic:N` gets `./` in front (the same
/// file), so the two never look alike; a path that is not UTF-8 is shown lossily in `input`,
/// its exact bytes in `input_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputName {
    pub input: String,
    pub input_bytes: Option<Vec<u8>>,
}

impl InputName {
    pub fn of(source: &Source) -> InputName {
        use std::os::unix::ffi::OsStrExt;
        match source {
            Source::Synthetic(n) => InputName {
                input: format!("synthetic:{n}"),
                input_bytes: None,
            },
            Source::File(p) => {
                let bytes = p.as_os_str().as_bytes();
                let (text, exact) = match std::str::from_utf8(bytes) {
                    Ok(t) => (t.to_string(), true),
                    Err(_) => (String::from_utf8_lossy(bytes).into_owned(), false),
                };
                let input = if text.starts_with("synthetic:") {
                    format!("./{text}")
                } else {
                    text
                };
                InputName {
                    input,
                    input_bytes: (!exact).then(|| bytes.to_vec()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_names_keep_every_file_apart_from_generated_images() {
        use std::os::unix::ffi::OsStrExt;
        let file = |b: &[u8]| Source::File(std::ffi::OsStr::from_bytes(b).into());
        let n = InputName::of(&Source::Synthetic(5));
        assert_eq!((n.input.as_str(), n.input_bytes), ("synthetic:5", None));
        let n = InputName::of(&file(b"synthetic:5"));
        assert_eq!((n.input.as_str(), n.input_bytes), ("./synthetic:5", None));
        // `./synthetic:5` is that same file.
        assert_eq!(n.input.parse::<Source>().unwrap(), file(b"./synthetic:5"));
        let n = InputName::of(&file(b"/p/a\xff.jpg"));
        assert_eq!(n.input, "/p/a\u{fffd}.jpg");
        assert_eq!(n.input_bytes.as_deref(), Some(&b"/p/a\xff.jpg"[..]));
        // Two names that show alike are told apart by their bytes.
        let m = InputName::of(&file(b"/p/a\xfe.jpg"));
        assert_eq!(m.input, n.input);
        assert_ne!(m.input_bytes, n.input_bytes);
        let n = InputName::of(&file("/p/é.jpg".as_bytes()));
        assert_eq!((n.input.as_str(), n.input_bytes), ("/p/é.jpg", None));
    }
}
