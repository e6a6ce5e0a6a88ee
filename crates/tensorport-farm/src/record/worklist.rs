//! The worklist line a farm hands a producer on its standard input: an input to prepare, or
//! one to leave out.

use tensorport_vision::Source;

/// The worklist record for input `index`, with its terminating NUL: `INDEX<TAB>f<TAB>PATH` for
/// a file (the path's bytes as they are: any name round-trips, newlines and non-UTF-8 bytes
/// included, since a path cannot hold a NUL) or `INDEX<TAB>s<TAB>N` for synthetic image N.
pub fn work_record(index: u64, source: &Source) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut rec = format!("{index}\t").into_bytes();
    match source {
        Source::File(p) => {
            rec.extend_from_slice(b"f\t");
            rec.extend_from_slice(p.as_os_str().as_bytes());
        }
        Source::Synthetic(n) => rec.extend_from_slice(format!("s\t{n}").as_bytes()),
    }
    rec.push(0);
    rec
}

/// The worklist record that withdraws input `index` (`INDEX<TAB>x<TAB>`, with its NUL): its
/// result came from another producer, so a producer that has not started it leaves it out.
pub fn withdraw_record(index: u64) -> Vec<u8> {
    format!("{index}\tx\t\0").into_bytes()
}

/// What a worklist record asks of a producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// Prepare and submit this input.
    Input(u64, Source),
    /// Leave out this input if it has not started on it ([`withdraw_record`]).
    Withdraw(u64),
}

/// Reads a worklist record (without its NUL), or says what is wrong with it.
pub fn parse_work_record(rec: &[u8]) -> Result<Work, &'static str> {
    use std::os::unix::ffi::OsStrExt;
    let mut parts = rec.splitn(3, |&b| b == b'\t');
    let (Some(idx), Some(kind), Some(what)) = (parts.next(), parts.next(), parts.next()) else {
        return Err("fewer than three fields");
    };
    let number = |b: &[u8]| {
        std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
    };
    let idx = number(idx).ok_or("a bad index")?;
    let source = match kind {
        b"f" if !what.is_empty() => Source::File(std::ffi::OsStr::from_bytes(what).into()),
        b"f" => return Err("an empty path"),
        b"s" => Source::Synthetic(number(what).ok_or("a bad image number")?),
        b"x" if what.is_empty() => return Ok(Work::Withdraw(idx)),
        b"x" => return Err("a withdrawal with more"),
        _ => return Err("an unknown kind"),
    };
    Ok(Work::Input(idx, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worklist_records_read_back_whatever_the_name() {
        use std::os::unix::ffi::OsStrExt;
        let names: [&[u8]; 5] = [
            b"a.jpg",
            b"img04x\nimg05y.png",
            b"x.jpg\n/etc/passwd",
            b"tab\there\tand\tthere.jpg",
            b"not-utf8-\xff\xfe.jpg",
        ];
        for name in names {
            let src = Source::File(std::ffi::OsStr::from_bytes(name).into());
            let rec = work_record(9, &src);
            assert_eq!(rec.iter().filter(|&&b| b == 0).count(), 1);
            assert_eq!(rec.last(), Some(&0));
            assert_eq!(
                parse_work_record(&rec[..rec.len() - 1]),
                Ok(Work::Input(9, src))
            );
        }
        // A file named like a synthetic image stays a file.
        let file = Source::File("synthetic:3".into());
        let rec = work_record(1, &file);
        assert_eq!(
            parse_work_record(&rec[..rec.len() - 1]),
            Ok(Work::Input(1, file))
        );
        let rec = work_record(7, &Source::Synthetic(3));
        assert_eq!(rec, b"7\ts\t3\0");
        assert_eq!(
            parse_work_record(b"7\ts\t3"),
            Ok(Work::Input(7, Source::Synthetic(3)))
        );
        let w = withdraw_record(12);
        assert_eq!(w, b"12\tx\t\0");
        assert_eq!(parse_work_record(&w[..w.len() - 1]), Ok(Work::Withdraw(12)));
        assert_eq!(
            parse_work_record(b"12\tx\ta.jpg"),
            Err("a withdrawal with more")
        );
        assert_eq!(
            parse_work_record(b"7 a.jpg"),
            Err("fewer than three fields")
        );
        assert_eq!(parse_work_record(b"x\tf\ta.jpg"), Err("a bad index"));
        assert_eq!(parse_work_record(b"1\tf\t"), Err("an empty path"));
        assert_eq!(parse_work_record(b"1\ts\tq"), Err("a bad image number"));
        assert_eq!(parse_work_record(b"1\tz\tq"), Err("an unknown kind"));
    }
}
