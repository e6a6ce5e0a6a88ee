//! Lengths bounded while decoding, not after.
//!
//! A list's length comes first on the wire; serde's `Vec` would believe it (reserving up to
//! 1 MiB at once) and then keep every element, so a 1 MiB frame of one-byte varints could become
//! 8 MiB of `u64`s before any check ran. These `deserialize_with` helpers refuse a list or
//! string as soon as its length is read — before an element is decoded or a byte reserved — and
//! never keep more than their bound.
//!
//! postcard keeps no text of a serde error, so the refusal (what, how long, the bound) is left in
//! a thread-local for [`take_overrun`], which `decode_*` turns into the precise [`WireError`].

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

use crate::WireError;

/// A list or string that was longer than its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overrun {
    pub(crate) what: &'static str,
    pub(crate) len: usize,
    pub(crate) max: usize,
}

impl Overrun {
    pub(crate) fn into_error(self) -> WireError {
        match self.what {
            "shape" => WireError::BadRank(self.len),
            what => WireError::TooLong {
                what,
                len: self.len,
                max: self.max,
            },
        }
    }
}

thread_local! {
    static LAST: Cell<Option<Overrun>> = const { Cell::new(None) };
}

/// The overrun that ended the last decode on this thread, if one did (and forgets it).
pub(crate) fn take_overrun() -> Option<Overrun> {
    LAST.with(|l| l.take())
}

fn overrun<E: Error>(what: &'static str, len: usize, max: usize) -> E {
    LAST.with(|l| l.set(Some(Overrun { what, len, max })));
    E::custom(format_args!("{what} of {len}, more than {max}"))
}

/// What a bounded field is called in errors, and its bound.
pub(crate) trait Bound {
    const WHAT: &'static str;
    const MAX: usize;
}

macro_rules! bound {
    ($name:ident, $what:literal, $max:expr) => {
        pub(crate) struct $name;
        impl Bound for $name {
            const WHAT: &'static str = $what;
            const MAX: usize = $max;
        }
    };
}

bound!(Shape, "shape", crate::MAX_DIMS);
bound!(Strides, "strides", crate::MAX_DIMS);
bound!(Handle, "IPC handle", 64);
bound!(Name, "client name", crate::MAX_NAME_LEN);
bound!(Message, "error message", crate::MAX_MESSAGE_LEN);
bound!(Grants, "grant", crate::MAX_GRANT);
bound!(Sessions, "session list", 256);

struct SeqVisitor<T, B>(PhantomData<(T, B)>);

impl<'de, T: Deserialize<'de>, B: Bound> Visitor<'de> for SeqVisitor<T, B> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} of at most {} elements", B::WHAT, B::MAX)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let hint = seq.size_hint().unwrap_or(0);
        if hint > B::MAX {
            return Err(overrun(B::WHAT, hint, B::MAX));
        }
        let mut v = Vec::with_capacity(hint);
        while let Some(x) = seq.next_element()? {
            if v.len() == B::MAX {
                return Err(overrun(B::WHAT, B::MAX + 1, B::MAX));
            }
            v.push(x);
        }
        Ok(v)
    }
}

/// A list of at most `B::MAX` elements.
pub(crate) fn vec<'de, D, T, B>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
    B: Bound,
{
    d.deserialize_seq(SeqVisitor::<T, B>(PhantomData))
}

struct OptVisitor<T, B>(PhantomData<(T, B)>);

impl<'de, T: Deserialize<'de>, B: Bound> Visitor<'de> for OptVisitor<T, B> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no {} or one of at most {} elements", B::WHAT, B::MAX)
    }

    fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        vec::<D, T, B>(d).map(Some)
    }
}

/// An optional list of at most `B::MAX` elements.
pub(crate) fn opt_vec<'de, D, T, B>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
    B: Bound,
{
    d.deserialize_option(OptVisitor::<T, B>(PhantomData))
}

struct StrVisitor<B>(PhantomData<B>);

impl<B: Bound> StrVisitor<B> {
    fn check<E: Error>(s: &str) -> Result<String, E> {
        if s.len() > B::MAX {
            return Err(overrun(B::WHAT, s.len(), B::MAX));
        }
        Ok(s.to_owned())
    }
}

impl<'de, B: Bound> Visitor<'de> for StrVisitor<B> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} of at most {} bytes", B::WHAT, B::MAX)
    }

    fn visit_borrowed_str<E: Error>(self, s: &'de str) -> Result<String, E> {
        Self::check(s)
    }

    fn visit_str<E: Error>(self, s: &str) -> Result<String, E> {
        Self::check(s)
    }
}

/// A string of at most `B::MAX` bytes, checked before it is copied out of the frame.
pub(crate) fn string<'de, D, B>(d: D) -> Result<String, D::Error>
where
    D: Deserializer<'de>,
    B: Bound,
{
    d.deserialize_str(StrVisitor::<B>(PhantomData))
}
