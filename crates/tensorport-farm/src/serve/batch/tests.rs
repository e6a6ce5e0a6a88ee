//! The batcher against real sessions: what it takes, gathers and answers.

use std::sync::mpsc;
use std::sync::Arc;

use tensorport::{DType, Producer, ProducerConfig, ServerConfig, TensorSpec};

use super::*;
use crate::record::scores_from_bytes;
use crate::serve::engine::HostInput;

const SHAPE: [usize; 3] = [3, 2, 2];

/// An engine on a thread of its own holding two batches, as ONNX Runtime's GPU sessions
/// do: each image is answered with its first value, after a pause per batch.
struct Queued {
    jobs: mpsc::Sender<Vec<f32>>,
    done: mpsc::Receiver<(Scores, Duration)>,
    in_flight: usize,
    most_in_flight: Arc<AtomicU64>,
    runs: RunTimes,
}

impl Queued {
    fn start(most_in_flight: Arc<AtomicU64>) -> Queued {
        let (jobs, todo) = mpsc::channel::<Vec<f32>>();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            for rows in todo {
                let t0 = Instant::now();
                std::thread::sleep(Duration::from_millis(3));
                let scores = rows.chunks(12).map(|image| vec![image[0]]).collect();
                if done.send((scores, t0.elapsed())).is_err() {
                    break;
                }
            }
        });
        Queued {
            jobs,
            done: finished,
            in_flight: 0,
            most_in_flight,
            runs: RunTimes::default(),
        }
    }
}

impl Engine for Queued {
    fn max_batch(&self) -> usize {
        16
    }
    fn lend(&mut self, rows: usize) -> Result<Input, EngineError> {
        Ok(Input::Host(HostInput::new(Vec::new(), rows, SHAPE)))
    }
    fn submit(&mut self, input: Input) -> Result<Submitted, EngineError> {
        while self.in_flight >= self.depth() {
            let _ = self.collect();
        }
        let h = input.into_host("a test")?;
        self.jobs.send(h.into_pixels()).unwrap();
        self.in_flight += 1;
        self.most_in_flight
            .fetch_max(self.in_flight as u64, Ordering::Relaxed);
        Ok(Submitted::InFlight)
    }
    fn collect(&mut self) -> Result<Scores, EngineError> {
        if self.in_flight == 0 {
            return Ok(Vec::new());
        }
        self.in_flight -= 1;
        let (scores, took) = self.done.recv().unwrap();
        self.runs.record(took);
        Ok(scores)
    }
    fn depth(&self) -> usize {
        2
    }
    fn run_time(&self, _: usize) -> Option<Duration> {
        self.runs.mean()
    }
    fn runs(&self) -> Option<RunTimes> {
        Some(self.runs)
    }
}

#[test]
fn an_engine_holding_two_batches_answers_every_request_with_its_own_row() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let mut sc = ServerConfig::new(&sock);
    sc.slot_size = 48;
    let server = Server::bind(sc).unwrap();
    let stop = crate::process::Stop::new();
    let images = AtomicU64::new(0);
    let most = Arc::new(AtomicU64::new(0));
    let (producers, each) = (3u32, 300u32);
    // A watchdog, not a timing: a loop that never drained would hang the test run.
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let finished = finished.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            while !finished.load(Ordering::SeqCst) {
                if t.elapsed() > Duration::from_secs(120) {
                    eprintln!("the batch loop did not end within 120 s");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let lp = BatchLoop {
                server: &server,
                max_batch: 16,
                max_wait: Duration::from_millis(1),
                sink: false,
                shape: SHAPE,
                stop: &stop,
                metrics: None,
                images: &images,
            };
            lp.run(&mut CpuBatcher, &mut Queued::start(most.clone()))
        });
        let clients: Vec<_> = (0..producers)
            .map(|p| {
                let sock = sock.clone();
                s.spawn(move || {
                    let mut cfg = ProducerConfig::new(format!("p{p}"));
                    (cfg.slots, cfg.slot_size) = (8, 48);
                    let mut c = Producer::connect(&sock, cfg).unwrap();
                    let spec = TensorSpec::new(DType::F32, &[3, 2, 2]);
                    let mut sent = std::collections::HashMap::new();
                    let mut answered = 0;
                    let check =
                        |c: &mut Producer, sent: &mut std::collections::HashMap<u64, f32>| {
                            let done = c.recv_result(Duration::from_secs(20)).unwrap();
                            let want = sent.remove(&done.request_id).expect("answered once");
                            let got = scores_from_bytes(&done.result.unwrap()).unwrap();
                            assert_eq!(got, vec![want]);
                        };
                    for i in 0..each {
                        let value = (p * 10_000 + i) as f32;
                        while c.in_flight() >= 8 {
                            check(&mut c, &mut sent);
                            answered += 1;
                        }
                        let mut lease = c.lease(Duration::from_secs(20)).unwrap();
                        lease.write_pod(0, &[value; 12]);
                        sent.insert(lease.submit(&spec).unwrap(), value);
                    }
                    while answered < each {
                        check(&mut c, &mut sent);
                        answered += 1;
                    }
                    assert!(sent.is_empty());
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
        stop.request();
        worker.join().unwrap().unwrap();
    });
    finished.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    assert_eq!(images.load(Ordering::Relaxed), u64::from(producers * each));
    assert_eq!(
        most.load(Ordering::Relaxed),
        2,
        "a batch was queued behind another"
    );
}
