//! The tests' in-process server: checks every tensor and answers with its checksum, holding
//! the requests of producers it is told to hold.

use super::*;

/// An in-process server whose consumer thread checks every tensor and answers with its checksum.
pub(crate) struct CheckingServer {
    pub(crate) server: Arc<Server>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) verified: Arc<AtomicU64>,
    pub(crate) torn: Arc<AtomicU64>,
    /// Requests to hold (not release) per producer name prefix, and the held ones.
    pub(crate) held: Arc<Mutex<Vec<tensorport::Request>>>,
    pub(crate) hold_from: Arc<Mutex<Option<(String, usize)>>>,
    pub(crate) per_producer: Arc<Mutex<HashMap<String, u64>>>,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
}

impl CheckingServer {
    /// A consumer thread per `config.consumers`, all checking and answering.
    pub(crate) fn start(config: ServerConfig) -> CheckingServer {
        let consumers = config.consumers.max(1);
        let server = Arc::new(Server::bind(config).expect("bind"));
        let stop = Arc::new(AtomicBool::new(false));
        let verified = Arc::new(AtomicU64::new(0));
        let torn = Arc::new(AtomicU64::new(0));
        let held = Arc::new(Mutex::new(Vec::new()));
        let hold_from: Arc<Mutex<Option<(String, usize)>>> = Arc::new(Mutex::new(None));
        let per_producer = Arc::new(Mutex::new(HashMap::new()));
        let threads = (0..consumers)
            .map(|_| {
                let (s, st, v, t, h, hf, pp) = (
                    server.clone(),
                    stop.clone(),
                    verified.clone(),
                    torn.clone(),
                    held.clone(),
                    hold_from.clone(),
                    per_producer.clone(),
                );
                std::thread::spawn(move || {
                    while !st.load(Ordering::SeqCst) {
                        let req = match s.recv_timeout(Duration::from_millis(50)) {
                            Ok(Some(r)) => r,
                            Ok(None) => continue,
                            Err(_) => break,
                        };
                        let bytes = req.bytes();
                        if verify(bytes) {
                            v.fetch_add(1, Ordering::SeqCst);
                        } else {
                            t.fetch_add(1, Ordering::SeqCst);
                        }
                        *pp.lock()
                            .unwrap()
                            .entry(req.producer().to_string())
                            .or_default() += 1;
                        let answer =
                            encode_answer(checksum(bytes), req.desc().numel(), req.desc().dtype());
                        let mut hold = hf.lock().unwrap();
                        if let Some((prefix, n)) = hold.as_mut() {
                            if req.producer().starts_with(prefix.as_str()) && *n > 0 {
                                *n -= 1;
                                h.lock().unwrap().push(req);
                                continue;
                            }
                        }
                        drop(hold);
                        let _ = req.respond(&answer);
                    }
                })
            })
            .collect();
        CheckingServer {
            server,
            stop,
            verified,
            torn,
            held,
            hold_from,
            per_producer,
            threads,
        }
    }
}

impl Drop for CheckingServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
