//! The records producers and farms exchange: the result line (one JSON line per input), its
//! stage times, the worklist line a farm hands a producer, and the writer of result lines.

use std::io::Write;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tensorport_vision::Source;

/// One line of a producer's output: the answer for one input.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResultLine {
    /// Position of the input in the input list.
    pub index: u64,
    /// The file, or `synthetic:N`.
    pub input: String,
    /// Index of the highest score (absent on error).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub class: Option<usize>,
    /// Class scores (logits), exactly as the model computed them.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub scores: Option<Vec<f32>>,
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

/// Index of the largest score.
pub fn argmax(v: &[f32]) -> Option<usize> {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
}

/// Milliseconds, as the records count them.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The worklist line for input `index`: `INDEX<TAB>SOURCE`, with its newline.
pub fn work_line(index: u64, source: &Source) -> String {
    format!("{index}\t{source}\n")
}

/// Reads a worklist line (without its newline), or says what is wrong with it.
pub fn parse_work_line(line: &str) -> Result<(u64, Source), &'static str> {
    let (idx, src) = line.split_once('\t').ok_or("no tab")?;
    let idx = idx.trim().parse::<u64>().map_err(|_| "a bad index")?;
    let src: Source = src.trim().parse().expect("infallible");
    Ok((idx, src))
}

/// Writes a producer's result lines, each flushed whole, and counts them.
pub struct LineWriter {
    out: Box<dyn Write>,
    producer: String,
    profile: bool,
    written: u64,
}

impl LineWriter {
    /// Lines for producer `producer`, with stage times if `profile`.
    pub fn new(out: Box<dyn Write>, producer: String, profile: bool) -> LineWriter {
        LineWriter {
            out,
            producer,
            profile,
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
        let line = ResultLine {
            index,
            input: source.to_string(),
            class: None,
            scores: None,
            error: Some(error),
            latency_ms: t0.map_or(0.0, |t| ms(t.elapsed())),
            producer: self.producer.clone(),
            stages: stages.filter(|_| self.profile),
        };
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
            Ok(b) => match tensorport_dfdx::scores_from_bytes(&b) {
                Some(s) => (Some(s), None),
                None => (None, Some("the server sent a malformed result".to_string())),
            },
            Err(e) => (None, Some(e.to_string())),
        };
        let line = ResultLine {
            index,
            input,
            class: scores.as_deref().and_then(argmax),
            scores,
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
    pub input: String,
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
    fn worklist_lines_read_back() {
        let line = work_line(7, &Source::Synthetic(3));
        assert_eq!(line, "7\tsynthetic:3\n");
        assert_eq!(
            parse_work_line(line.trim_end()),
            Ok((7, Source::Synthetic(3)))
        );
        assert_eq!(parse_work_line("7 synthetic:3"), Err("no tab"));
        assert_eq!(parse_work_line("x\ta.jpg"), Err("a bad index"));
    }

    #[test]
    fn argmax_takes_the_largest() {
        assert_eq!(argmax(&[0.1, 3.0, -2.0]), Some(1));
        assert_eq!(argmax(&[]), None);
    }
}
