//! What a remote producer has sent and not had answered, and the result lines it writes.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::time::Instant;

use arrow_array::{BooleanArray, RecordBatch};
use tensorport_bridge::nixl::Outbound;
use tensorport_bridge::schema::ResultRow;
use tensorport_farm::record::{argmax, ResultLine};

use crate::cli::CliResult;

/// A request sent and not yet answered.
pub(super) struct Pending {
    pub(super) input: String,
    pub(super) sent: Instant,
}

pub(super) struct Run {
    pub(super) out: Box<dyn Write>,
    pub(super) name: String,
    pub(super) pending: HashMap<u64, Pending>,
    /// Batches sent with requests still unanswered, for sending again on a new stream.
    pub(super) unanswered: VecDeque<RecordBatch>,
    pub(super) lines: u64,
    pub(super) errors: u64,
    pub(super) bytes: u64,
    /// With `--transport nixl`: the registered slots and which request each holds.
    pub(super) nixl: Option<Outbound>,
}

impl Run {
    pub(super) fn emit(
        &mut self,
        index: u64,
        input: &str,
        outcome: Result<Vec<f32>, String>,
        latency: f64,
    ) -> CliResult<()> {
        let (class, scores, error) = match outcome {
            Ok(s) => (argmax(&s), Some(s), None),
            Err(e) => (None, None, Some(e)),
        };
        if error.is_some() {
            self.errors += 1;
        }
        let line = ResultLine {
            index,
            input: input.to_string(),
            input_bytes: None,
            class,
            scores,
            top_k: None,
            error,
            latency_ms: latency,
            producer: self.name.clone(),
            stages: None,
        };
        let s = serde_json::to_string(&line).expect("serialisable");
        writeln!(self.out, "{s}")?;
        self.lines += 1;
        Ok(())
    }

    pub(super) fn answer(&mut self, rows: Vec<ResultRow>) -> CliResult<()> {
        for r in rows {
            // An answer to a request of an earlier stream, already answered: not again.
            let Some(p) = self.pending.remove(&r.id) else {
                continue;
            };
            // Answered: the gateway has read its slot.
            if let Some(n) = self.nixl.as_mut() {
                n.release(r.id);
            }
            let outcome = match r.outcome {
                Ok(b) if b.len() % 4 == 0 => Ok(b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect()),
                Ok(_) => Err("the server sent a malformed result".to_string()),
                Err((code, msg)) => Err(format!(
                    "{:?}: {msg}",
                    tensorport::wire::ErrorCode::from_u16(code)
                )),
            };
            let latency = p.sent.elapsed().as_secs_f64() * 1e3;
            self.emit(r.id, &p.input, outcome, latency)?;
        }
        self.out.flush()?;
        // Forget every batch all of whose requests are answered, wherever it stands: one
        // request that never gets an answer keeps its own batch, not every batch after it (so
        // no more batches are kept than requests are pending).
        let pending = &self.pending;
        self.unanswered
            .retain(|b| ids(b).iter().any(|i| pending.contains_key(i)));
        Ok(())
    }

    /// The unanswered part of each batch sent, to send again.
    pub(super) fn resend(&self) -> Vec<RecordBatch> {
        self.unanswered
            .iter()
            .filter_map(|b| {
                let keep = BooleanArray::from(
                    ids(b)
                        .iter()
                        .map(|i| self.pending.contains_key(i))
                        .collect::<Vec<_>>(),
                );
                let f = arrow_select::filter::filter_record_batch(b, &keep).ok()?;
                (f.num_rows() > 0).then_some(f)
            })
            .collect()
    }
}

/// The request ids of a batch (its first column).
fn ids(b: &RecordBatch) -> &[u64] {
    use arrow_array::cast::AsArray;
    b.column(0)
        .as_primitive::<arrow_array::types::UInt64Type>()
        .values()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn batch(ids: &[u64]) -> RecordBatch {
        let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "id",
            arrow_schema::DataType::UInt64,
            false,
        )]));
        let col = Arc::new(arrow_array::UInt64Array::from(ids.to_vec()));
        RecordBatch::try_new(schema, vec![col]).unwrap()
    }

    /// A request that is never answered keeps only its own batch: the batches after it are
    /// dropped as soon as they are answered, so the resend buffer stays within the window.
    #[test]
    fn the_resend_buffer_keeps_only_batches_with_unanswered_requests() {
        let mut run = Run {
            out: Box::new(Vec::new()),
            name: "t".into(),
            pending: HashMap::new(),
            unanswered: VecDeque::new(),
            lines: 0,
            errors: 0,
            bytes: 0,
            nixl: None,
        };
        let mut next = 0u64;
        for round in 0..1000u64 {
            let ids: Vec<u64> = (next..next + 4).collect();
            next += 4;
            for &i in &ids {
                run.pending.insert(
                    i,
                    Pending {
                        input: format!("in-{i}"),
                        sent: Instant::now(),
                    },
                );
            }
            run.unanswered.push_back(batch(&ids));
            // Every request is answered except request 1, forever.
            let rows = ids
                .iter()
                .filter(|&&i| i != 1)
                .map(|&i| ResultRow {
                    id: i,
                    outcome: Ok(vec![0; 4]),
                })
                .collect();
            run.answer(rows).unwrap();
            assert!(
                run.unanswered.len() <= 2,
                "round {round}: {} batches kept",
                run.unanswered.len()
            );
        }
        assert_eq!(run.unanswered.len(), 1);
        let again = run.resend();
        assert_eq!(again.len(), 1);
        assert_eq!(ids(&again[0]), &[1]);
    }
}
