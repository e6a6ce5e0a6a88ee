//! Just enough of protobuf's wire format to walk an ONNX model: a reader of one message's
//! fields that checks every length against what is left (a hostile file gets an error, never a
//! panic or an allocation it names), and the writer of a field.

use std::fmt;

/// What is wrong with a message's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed(pub &'static str);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// One field's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Varint(u64),
    /// A length-delimited field's contents: bytes, a string or a message.
    Bytes(&'a [u8]),
    /// A fixed 32- or 64-bit value (not read further).
    Fixed,
}

/// One field: its number, its value, and its bytes as they lie (tag included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Field<'a> {
    pub number: u32,
    pub value: Value<'a>,
    pub raw: &'a [u8],
}

/// The fields of one message, in order.
pub(crate) struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    pub fn new(buf: &'a [u8]) -> Fields<'a> {
        Fields { buf, pos: 0 }
    }

    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = *self
                .buf
                .get(self.pos)
                .ok_or(Malformed("a number runs past the end"))?;
            self.pos += 1;
            if shift == 63 && b > 1 {
                return Err(Malformed("a number over 64 bits"));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Malformed("a number over 64 bits"))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], Malformed> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(Malformed("a field runs past the end of its message"));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    /// The next field, or `None` at the end.
    pub fn next_field(&mut self) -> Result<Option<Field<'a>>, Malformed> {
        if self.pos == self.buf.len() {
            return Ok(None);
        }
        let start = self.pos;
        let tag = self.varint()?;
        let number = u32::try_from(tag >> 3)
            .ok()
            .filter(|&n| n > 0)
            .ok_or(Malformed("a field number out of range"))?;
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let n = self.varint()?;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            _ => return Err(Malformed("a group or an unknown wire type")),
        };
        Ok(Some(Field {
            number,
            value,
            raw: &self.buf[start..self.pos],
        }))
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Writes a length-delimited field.
pub(crate) fn put_bytes(out: &mut Vec<u8>, number: u32, bytes: &[u8]) {
    put_varint(out, (u64::from(number) << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Writes a varint field.
#[cfg(test)]
pub(crate) fn put_u64(out: &mut Vec<u8>, number: u32, v: u64) {
    put_varint(out, u64::from(number) << 3);
    put_varint(out, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_back_as_written_and_every_cut_is_an_error() {
        let mut m = Vec::new();
        put_u64(&mut m, 1, 300);
        put_bytes(&mut m, 7, b"hello");
        put_u64(&mut m, 536_870_911, u64::MAX);
        let mut f = Fields::new(&m);
        let a = f.next_field().unwrap().unwrap();
        assert_eq!((a.number, a.value), (1, Value::Varint(300)));
        let b = f.next_field().unwrap().unwrap();
        assert_eq!((b.number, b.value), (7, Value::Bytes(&b"hello"[..])));
        assert_eq!(b.raw, &m[3..10]);
        let c = f.next_field().unwrap().unwrap();
        assert_eq!((c.number, c.value), (536_870_911, Value::Varint(u64::MAX)));
        assert_eq!(f.next_field().unwrap(), None);
        // Every prefix that cuts a field is refused, never read past.
        for cut in 1..m.len() {
            let mut f = Fields::new(&m[..cut]);
            let ends_whole = [3, 10].contains(&cut);
            let mut err = false;
            while let Some(r) = f.next_field().transpose() {
                if r.is_err() {
                    err = true;
                    break;
                }
            }
            assert_eq!(err, !ends_whole, "cut at {cut}");
        }
        // A length past the end, a group, field 0, an 11-byte number.
        for bad in [
            &[0x3a, 0x7f, 1][..],
            &[0x0b][..],
            &[0x00, 1][..],
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ][..],
        ] {
            assert!(Fields::new(bad).next_field().is_err(), "{bad:?}");
        }
    }
}
