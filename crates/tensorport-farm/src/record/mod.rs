//! The records producers and farms exchange: the result line (one JSON line per input), its
//! stage times, and the writer of result lines; the worklist line a farm hands a producer
//! (`worklist`), inputs' names (`names`) and the scores' JSON form (`score_form`) beside it.

use std::io::Write;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tensorport_vision::Source;

mod names;
pub mod score_form;
mod worklist;

pub use names::InputName;
pub use worklist::{parse_work_record, withdraw_record, work_record, Work};

/// One line of a producer's output: the answer for one input.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResultLine {
    /// Position of the input in the input list.
    pub index: u64,
    /// The file as it was given, or `synthetic:N` for generated image N ([`InputName`]: a file
    /// whose name would read as a generated image is written `./synthetic:N`).
    pub input: String,
    /// The file name's bytes, where they are not UTF-8 (`input` then shows each byte that is
    /// not as U+FFFD); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub input_bytes: Option<Vec<u8>>,
    /// Index of the highest score (absent on error).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub class: Option<usize>,
    /// Class scores (logits), exactly as the model computed them; a score that is not a finite
    /// number is the string `"NaN"`, `"Infinity"` or `"-Infinity"` ([`score_form`]).
    #[serde(
        skip_serializing_if = "Option::is_none",
        default,
        with = "score_form::scores"
    )]
    pub scores: Option<Vec<f32>>,
    /// In place of `scores` when only the best are kept ([`Keep::Top`]): `[class, score]` pairs,
    /// the highest score first.
    #[serde(
        skip_serializing_if = "Option::is_none",
        default,
        with = "score_form::top"
    )]
    pub top_k: Option<Vec<(usize, f32)>>,
    /// What went wrong for this input, if anything.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// From lease to result, in milliseconds.
    pub latency_ms: f64,
    /// Which producer did it.
    pub producer: String,
    /// Where the time went, when profiling.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub stages: Option<StageTimes>,
}

impl ResultLine {
    /// The line of input `index` (`source`) that got no scores, by `producer`: `error` says why.
    pub fn failed(index: u64, source: &Source, error: String, producer: String) -> ResultLine {
        let name = InputName::of(source);
        ResultLine {
            index,
            input: name.input,
            input_bytes: name.input_bytes,
            class: None,
            scores: None,
            top_k: None,
            error: Some(error),
            latency_ms: 0.0,
            producer,
            stages: None,
        }
    }
}

/// One input's time in each step, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct StageTimes {
    /// Reading the file (on the producer's reader thread, overlapping the rest).
    pub read_ms: f64,
    /// Decoding to RGB.
    pub decode_ms: f64,
    /// Resizing and cropping.
    pub resize_ms: f64,
    /// Normalising into the slot.
    pub normalise_ms: f64,
    /// Waiting for a free slot.
    pub lease_ms: f64,
    /// Handing the slot over (`submit`).
    pub submit_ms: f64,
    /// From submit to the result: the server's queue, batch wait, model, and the answer.
    pub result_ms: f64,
}

impl std::ops::AddAssign for StageTimes {
    fn add_assign(&mut self, o: StageTimes) {
        self.read_ms += o.read_ms;
        self.decode_ms += o.decode_ms;
        self.resize_ms += o.resize_ms;
        self.normalise_ms += o.normalise_ms;
        self.lease_ms += o.lease_ms;
        self.submit_ms += o.submit_ms;
        self.result_ms += o.result_ms;
    }
}

/// Index of the largest score, NaN left out (`None` where every score is NaN, or none).
pub fn argmax(v: &[f32]) -> Option<usize> {
    v.iter()
        .enumerate()
        .filter(|(_, s)| !s.is_nan())
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
}

/// The `k` highest scores as `(class, score)`, the highest first (equal scores: the lower
/// class first; NaN after every number).
pub fn top_k(v: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut all: Vec<(usize, f32)> = v.iter().copied().enumerate().collect();
    let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    let by_score = |a: &(usize, f32), b: &(usize, f32)| {
        key(b.1)
            .total_cmp(&key(a.1))
            .then(a.1.is_nan().cmp(&b.1.is_nan()))
            .then(a.0.cmp(&b.0))
    };
    if k < all.len() {
        all.select_nth_unstable_by(k, by_score);
        all.truncate(k);
    }
    all.sort_unstable_by(by_score);
    all
}

/// Which of the model's scores a result line keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Keep {
    /// Every score (`scores`).
    #[default]
    All,
    /// The `k` highest, with their classes (`top_k`): for models with many classes, or
    /// embeddings whose lines would otherwise be large.
    Top(usize),
}

/// What a result line holds when the model gives a score that is not a finite number (NaN,
/// an infinity: an f16 model that overflows, a division by zero in the graph).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum NonFinite {
    /// The scores as they are, each non-finite one as the string `"NaN"`, `"Infinity"` or
    /// `"-Infinity"` (the form of protobuf's JSON mapping); "class" is the largest score that
    /// is not NaN.
    #[default]
    Strings,
    /// An error line for that input, naming the first such score.
    Error,
}

impl NonFinite {
    pub fn name(self) -> &'static str {
        match self {
            NonFinite::Strings => "strings",
            NonFinite::Error => "error",
        }
    }
}

/// The first score of `v` that is not a finite number, as `(class, score)`.
pub fn first_non_finite(v: &[f32]) -> Option<(usize, f32)> {
    v.iter().copied().enumerate().find(|(_, s)| !s.is_finite())
}

/// A row of scores as a result's payload: little-endian `f32`s (docs/protocol.md).
pub fn scores_to_bytes(scores: &[f32]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        // Every answer takes this path: one copy of the row as it lies.
        bytemuck::cast_slice(scores).to_vec()
    } else {
        scores.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// The scores of a result's payload ([`scores_to_bytes`]); `None` if its length is not a
/// multiple of 4.
pub fn scores_from_bytes(bytes: &[u8]) -> Option<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// Milliseconds, as the records count them.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Writes a producer's result lines, each flushed whole, and counts them.
pub struct LineWriter {
    out: Box<dyn Write>,
    producer: String,
    profile: bool,
    keep: Keep,
    non_finite: NonFinite,
    written: u64,
}

impl LineWriter {
    /// Lines for producer `producer`, with stage times if `profile`, keeping `keep` of each
    /// input's scores, and scores that are not finite numbers as `non_finite` says.
    pub fn new(
        out: Box<dyn Write>,
        producer: String,
        profile: bool,
        keep: Keep,
        non_finite: NonFinite,
    ) -> LineWriter {
        LineWriter {
            out,
            producer,
            profile,
            keep,
            non_finite,
            written: 0,
        }
    }

    /// Lines written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    fn write(&mut self, line: &ResultLine) -> std::io::Result<()> {
        let s = serde_json::to_string(line).expect("serializable");
        writeln!(self.out, "{s}")?;
        self.out.flush()?;
        self.written += 1;
        Ok(())
    }

    /// The line for an input that gets no result from the server.
    pub fn failed(
        &mut self,
        index: u64,
        source: &Source,
        error: String,
        t0: Option<Instant>,
        stages: Option<StageTimes>,
    ) -> std::io::Result<()> {
        let mut line = ResultLine::failed(index, source, error, self.producer.clone());
        line.latency_ms = t0.map_or(0.0, |t| ms(t.elapsed()));
        line.stages = stages.filter(|_| self.profile);
        self.write(&line)
    }

    /// The line for `input`, given the server's answer to it.
    pub fn answered(
        &mut self,
        input: Submitted,
        result: Result<Vec<u8>, tensorport::RemoteError>,
    ) -> std::io::Result<()> {
        let Submitted {
            index,
            input,
            taken,
            submitted,
            mut stages,
        } = input;
        stages.result_ms = ms(submitted.elapsed());
        let (scores, error) = match result {
            Ok(b) => match scores_from_bytes(&b) {
                Some(s) => match (self.non_finite, first_non_finite(&s)) {
                    (NonFinite::Error, Some((class, x))) => (
                        None,
                        Some(format!(
                            "the model gave a score that is not a finite number ({} for class {class})",
                            score_form::name(x).unwrap_or("?")
                        )),
                    ),
                    _ => (Some(s), None),
                },
                None => (None, Some("the server sent a malformed result".to_string())),
            },
            Err(e) => (None, Some(e.to_string())),
        };
        let class = scores.as_deref().and_then(argmax);
        let (scores, top) = match (self.keep, scores) {
            (Keep::Top(k), Some(s)) => (None, Some(top_k(&s, k))),
            (_, s) => (s, None),
        };
        let line = ResultLine {
            index,
            input: input.input,
            input_bytes: input.input_bytes,
            class,
            scores,
            top_k: top,
            error,
            latency_ms: ms(taken.elapsed()),
            producer: self.producer.clone(),
            stages: self.profile.then_some(stages),
        };
        self.write(&line)
    }
}

/// An input handed to the server, waiting for its answer.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub index: u64,
    /// The input's name in its line.
    pub input: InputName,
    /// When its slot or buffer was taken.
    pub taken: Instant,
    /// When it was submitted.
    pub submitted: Instant,
    /// Its stage times so far.
    pub stages: StageTimes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_highest_first_and_breaks_ties_by_class() {
        let v = [0.5, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(top_k(&v, 3), vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        assert_eq!(top_k(&v, 1), vec![(1, 3.0)]);
        assert_eq!(top_k(&[1.0, 2.0], 5), vec![(1, 2.0), (0, 1.0)]);
        assert_eq!(top_k(&[1.0, 2.0], 0), vec![]);
        assert_eq!(top_k(&[], 3), vec![]);
    }

    #[test]
    fn scores_round_trip_as_little_endian_bytes() {
        let s = [1.5f32, -0.0, f32::MAX, 3.25e-7];
        let b = scores_to_bytes(&s);
        assert_eq!(&b[..4], &1.5f32.to_le_bytes());
        assert_eq!(scores_from_bytes(&b).unwrap(), s);
        assert_eq!(scores_from_bytes(&b[..5]), None);
        assert_eq!(scores_from_bytes(&[]), Some(vec![]));
    }

    #[test]
    fn argmax_takes_the_largest() {
        assert_eq!(argmax(&[0.1, 3.0, -2.0]), Some(1));
        assert_eq!(argmax(&[]), None);
        // NaN is no score to pick; an infinity is.
        assert_eq!(argmax(&[0.1, f32::NAN, -2.0]), Some(0));
        assert_eq!(argmax(&[0.1, f32::INFINITY, f32::NAN]), Some(1));
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), None);
        assert_eq!(
            top_k(&[f32::NAN, 1.0, f32::NEG_INFINITY], 3)
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            vec![1, 2, 0]
        );
    }

    /// A writer's line for `scores` with `non_finite`, read back as JSON.
    fn line_for(scores: &[f32], keep: Keep, non_finite: NonFinite) -> serde_json::Value {
        #[derive(Clone)]
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Shared(Default::default());
        let mut w = LineWriter::new(Box::new(buf.clone()), "p".into(), false, keep, non_finite);
        let input = Submitted {
            index: 4,
            input: InputName::of(&Source::Synthetic(4)),
            taken: Instant::now(),
            submitted: Instant::now(),
            stages: StageTimes::default(),
        };
        w.answered(input, Ok(scores_to_bytes(scores))).unwrap();
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(text.ends_with('\n') && text.lines().count() == 1, "{text}");
        // Whatever the scores, the line reads back as a result line.
        let back: ResultLine = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(back.index, 4);
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn non_finite_scores_travel_as_strings_or_make_an_error_line() {
        let s = [1.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.25];
        let v = line_for(&s, Keep::All, NonFinite::Strings);
        assert_eq!(
            v["scores"],
            serde_json::json!([1.5, "NaN", "Infinity", "-Infinity", -0.25])
        );
        assert_eq!(v["class"], 2);
        let back: ResultLine = serde_json::from_value(v).unwrap();
        let got = back.scores.unwrap();
        assert_eq!(got[0], 1.5);
        assert!(got[1].is_nan());
        assert_eq!(&got[2..], &s[2..]);
        let v = line_for(&s, Keep::Top(2), NonFinite::Strings);
        assert_eq!(v["top_k"], serde_json::json!([[2, "Infinity"], [0, 1.5]]));
        let v = line_for(&s, Keep::All, NonFinite::Error);
        assert!(v.get("scores").is_none() && v.get("class").is_none(), "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.contains("NaN for class 1"), "{e}");
        // Finite scores are numbers either way.
        let v = line_for(&[0.5, 2.0], Keep::All, NonFinite::Error);
        assert_eq!(v["scores"], serde_json::json!([0.5, 2.0]));
        // A string that names no number is refused.
        let bad = r#"{"index":1,"input":"a","scores":["nan"],"latency_ms":0,"producer":"p"}"#;
        assert!(serde_json::from_str::<ResultLine>(bad).is_err());
    }
}
