//! Scores in result lines: a finite score as a JSON number, the others as the strings `"NaN"`,
//! `"Infinity"` and `"-Infinity"`, so that every value the model gives travels and reads back
//! (JSON has no number for them; serde_json would write `null`).

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

/// One score in its JSON form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score(pub f32);

/// The string a non-finite score is written as.
pub fn name(x: f32) -> Option<&'static str> {
    if x.is_nan() {
        Some("NaN")
    } else if x == f32::INFINITY {
        Some("Infinity")
    } else if x == f32::NEG_INFINITY {
        Some("-Infinity")
    } else {
        None
    }
}

impl Serialize for Score {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match name(self.0) {
            Some(n) => s.serialize_str(n),
            None => s.serialize_f32(self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Score {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Score, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Score;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number, \"NaN\", \"Infinity\" or \"-Infinity\"")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Score, E> {
                Ok(Score(v as f32))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Score, E> {
                Ok(Score(v as f32))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Score, E> {
                Ok(Score(v as f32))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Score, E> {
                match v {
                    "NaN" => Ok(Score(f32::NAN)),
                    "Infinity" => Ok(Score(f32::INFINITY)),
                    "-Infinity" => Ok(Score(f32::NEG_INFINITY)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `Option<Vec<f32>>` as a list of [`Score`]s.
pub mod scores {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<Vec<f32>>, s: S) -> Result<S::Ok, S::Error> {
        v.as_ref()
            .map(|v| v.iter().map(|&x| Score(x)).collect::<Vec<_>>())
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<f32>>, D::Error> {
        Ok(Option::<Vec<Score>>::deserialize(d)?.map(|v| v.into_iter().map(|s| s.0).collect()))
    }
}

/// `Option<Vec<(usize, f32)>>` as a list of `[class, Score]` pairs.
pub mod top {
    use super::*;

    pub fn serialize<S: Serializer>(
        v: &Option<Vec<(usize, f32)>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        v.as_ref()
            .map(|v| v.iter().map(|&(c, x)| (c, Score(x))).collect::<Vec<_>>())
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<(usize, f32)>>, D::Error> {
        Ok(Option::<Vec<(usize, Score)>>::deserialize(d)?
            .map(|v| v.into_iter().map(|(c, s)| (c, s.0)).collect()))
    }
}
