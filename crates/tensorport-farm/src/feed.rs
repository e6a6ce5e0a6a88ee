//! A producer's inputs: listed from a folder, counted out as synthetic images, or read from a
//! worklist on stdin (NUL-terminated records, `record::work_record`), with their files read ahead on a thread of their own, so file reads
//! overlap the preprocessing and results keep flowing while the producer waits for more work.

use std::collections::HashSet;
use std::io::BufRead;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tensorport_vision::Source;

use crate::config::Inputs;
use crate::error::{Error, Result};

/// A file's bytes (or why they could not be read) and how long the read took; `None` for a
/// synthetic image.
pub type ReadBytes = Option<(tensorport_vision::Result<Vec<u8>>, Duration)>;

/// One input, with its file's bytes read ahead.
pub struct Input {
    /// Its position in the input list (also its request id).
    pub index: u64,
    pub source: Source,
    pub bytes: ReadBytes,
}

/// What the next look at the feed found.
pub enum Next {
    Input(Input),
    /// Nothing yet.
    Wait,
    /// The inputs have ended.
    Done,
}

/// The inputs' channel, and where spent read buffers go back for reuse.
pub struct Feed {
    rx: mpsc::Receiver<Input>,
    spent: mpsc::Sender<Vec<u8>>,
    reading: Arc<Mutex<Reading>>,
    read_timeout: Duration,
    /// Inputs the farm withdrew (another producer answered them): left out when they come.
    withdrawn: Arc<Mutex<HashSet<u64>>>,
}

/// The file read under way on the feed's thread, and whether the producer gave up on it.
#[derive(Default)]
struct Reading {
    now: Option<(u64, Source, Instant)>,
    /// Answered as hung: when the read returns at last, the input is dropped.
    abandoned: Option<u64>,
}

impl Feed {
    /// Starts the thread that lists (or reads from stdin) the inputs and reads their files, up
    /// to `ahead` inputs ahead of the producer. A file whose read has not returned after
    /// `read_timeout` (a hung network mount, say) comes out of [`Feed::next`] as an input that
    /// failed, "hung while reading", so it gets its error line; the thread stays blocked on
    /// it, and the inputs after it wait (a farm hands them to another producer once this one
    /// stalls).
    pub fn start(inputs: &Inputs, ahead: usize, read_timeout: Duration) -> Result<Feed> {
        let withdrawn = Arc::new(Mutex::new(HashSet::new()));
        let items: Box<dyn Iterator<Item = (u64, Source)> + Send> = match inputs {
            Inputs::Dir(dir) => Box::new(
                tensorport_vision::list_images(dir)
                    .map_err(Error::Inputs)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| (i as u64, Source::File(p))),
            ),
            // Lazy: the count may be huge (the soak test runs producers that never finish).
            &Inputs::Synthetic(n) => Box::new((0..n).map(|i| (i, Source::Synthetic(i)))),
            Inputs::Worklist => Box::new(worklist(
                std::io::BufReader::new(std::io::stdin()),
                withdrawn.clone(),
            )),
        };
        let mut feed = Feed::spawn(items, ahead, read_timeout, read_ahead);
        feed.withdrawn = withdrawn;
        Ok(feed)
    }

    /// Starts the thread that reads `items` with `read`.
    fn spawn(
        items: Box<dyn Iterator<Item = (u64, Source)> + Send>,
        ahead: usize,
        read_timeout: Duration,
        read: fn(&Source, Vec<u8>) -> ReadBytes,
    ) -> Feed {
        let (tx, rx) = mpsc::sync_channel::<Input>(ahead.max(1));
        let (spent, reuse) = mpsc::channel::<Vec<u8>>();
        let reading = Arc::new(Mutex::new(Reading::default()));
        let watched = reading.clone();
        std::thread::spawn(move || {
            for (index, source) in items {
                if matches!(source, Source::File(_)) {
                    watched.lock().expect("not poisoned").now =
                        Some((index, source.clone(), Instant::now()));
                }
                let bytes = read(&source, reuse.try_recv().unwrap_or_default());
                {
                    let mut r = watched.lock().expect("not poisoned");
                    r.now = None;
                    // Given up on (answered as hung) while it read: dropped.
                    if r.abandoned.take_if(|&mut i| i == index).is_some() {
                        continue;
                    }
                }
                let input = Input {
                    index,
                    source,
                    bytes,
                };
                if tx.send(input).is_err() {
                    break;
                }
            }
        });
        Feed {
            rx,
            spent,
            reading,
            read_timeout,
            withdrawn: Arc::default(),
        }
    }

    /// The next input: waits up to `wait` for one (not at all for a zero wait). Inputs the
    /// farm has withdrawn are left out.
    pub fn next(&self, wait: Duration) -> Next {
        loop {
            match self.next_any(wait) {
                Next::Input(it)
                    if self
                        .withdrawn
                        .lock()
                        .expect("not poisoned")
                        .remove(&it.index) =>
                {
                    if let Some((Ok(buf), _)) = it.bytes {
                        self.reuse(buf);
                    }
                }
                next => return next,
            }
        }
    }

    fn next_any(&self, wait: Duration) -> Next {
        let next = if wait.is_zero() {
            match self.rx.try_recv() {
                Ok(it) => Next::Input(it),
                Err(mpsc::TryRecvError::Empty) => Next::Wait,
                Err(mpsc::TryRecvError::Disconnected) => Next::Done,
            }
        } else {
            match self.rx.recv_timeout(wait) {
                Ok(it) => Next::Input(it),
                Err(mpsc::RecvTimeoutError::Timeout) => Next::Wait,
                Err(mpsc::RecvTimeoutError::Disconnected) => Next::Done,
            }
        };
        match next {
            Next::Wait => self.hung().map_or(Next::Wait, Next::Input),
            next => next,
        }
    }

    /// The input whose read has taken over the read timeout, failed as hung, once.
    fn hung(&self) -> Option<Input> {
        let mut r = self.reading.lock().expect("not poisoned");
        let (index, source, since) = r.now.as_ref()?;
        let took = since.elapsed();
        if took < self.read_timeout || r.abandoned.is_some() {
            return None;
        }
        let (index, source) = (*index, source.clone());
        r.abandoned = Some(index);
        let problem = format!(
            "hung while reading: no answer from the file system after {:.0} s (a hung network \
             mount or device?); the producer gave up on it",
            took.as_secs_f64()
        );
        Some(Input {
            index,
            bytes: Some((
                Err(tensorport_vision::Error::Image {
                    path: source.to_string(),
                    problem,
                }),
                took,
            )),
            source,
        })
    }

    /// Gives a read buffer back for the next file.
    pub fn reuse(&self, mut buf: Vec<u8>) {
        tensorport_vision::trim_file_buffer(&mut buf);
        let _ = self.spent.send(buf);
    }
}

/// The most withdrawals a feed keeps at once.
const MAX_WITHDRAWN: usize = 1 << 16;

/// The inputs of a worklist (NUL-terminated `record::work_record`s) read from `from`, until it
/// ends; a withdrawal goes into `withdrawn`; a record that does not parse is logged and
/// skipped.
fn worklist(
    from: impl BufRead + Send,
    withdrawn: Arc<Mutex<HashSet<u64>>>,
) -> impl Iterator<Item = (u64, Source)> + Send {
    use crate::record::Work;
    from.split(0)
        .map_while(|rec| rec.ok())
        .filter_map(move |rec| match crate::record::parse_work_record(&rec) {
            Ok(Work::Input(i, source)) => Some((i, source)),
            Ok(Work::Withdraw(i)) => {
                let mut w = withdrawn.lock().expect("not poisoned");
                // Bounded: a farm withdraws only inputs given twice, a handful at the end of a
                // run; past the bound a withdrawal is not needed (the input is answered once
                // anyway) and is dropped.
                if w.len() < MAX_WITHDRAWN {
                    w.insert(i);
                }
                None
            }
            Err(why) => {
                let shown = String::from_utf8_lossy(&rec);
                tracing::warn!("ignoring worklist record with {why}: {shown:?}");
                None
            }
        })
}

/// Reads a file's bytes into `buf` (reused), timing it.
pub fn read_ahead(src: &Source, mut buf: Vec<u8>) -> ReadBytes {
    let Source::File(path) = src else {
        return None;
    };
    let t = Instant::now();
    let r = tensorport_vision::read_file(path, &mut buf).map(|()| buf);
    Some((r, t.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read of `hang.jpg` that takes 3 s; every other file reads at once.
    fn slow_read(src: &Source, buf: Vec<u8>) -> ReadBytes {
        if src.to_string() == "hang.jpg" {
            std::thread::sleep(Duration::from_secs(3));
        }
        Some((Ok(buf), Duration::ZERO))
    }

    fn names(items: &[&str]) -> Box<dyn Iterator<Item = (u64, Source)> + Send> {
        let v: Vec<(u64, Source)> = items
            .iter()
            .enumerate()
            .map(|(i, n)| (i as u64, Source::File((*n).into())))
            .collect();
        Box::new(v.into_iter())
    }

    #[test]
    fn a_read_that_hangs_fails_that_input_once_and_the_rest_follow() {
        let feed = Feed::spawn(
            names(&["a.jpg", "hang.jpg", "b.jpg"]),
            4,
            Duration::from_millis(200),
            slow_read,
        );
        let mut got = Vec::new();
        let t = Instant::now();
        while got.len() < 3 && t.elapsed() < Duration::from_secs(60) {
            match feed.next(Duration::from_millis(20)) {
                Next::Input(it) => got.push(it),
                Next::Wait => {}
                Next::Done => break,
            }
        }
        let summary: Vec<(u64, bool)> = got
            .iter()
            .map(|i| (i.index, matches!(i.bytes, Some((Ok(_), _)))))
            .collect();
        // The hung read is answered as failed, once, before it returns; its late bytes are
        // dropped; the input after it comes once the read returns.
        assert_eq!(summary, [(0, true), (1, false), (2, true)]);
        let Some((Err(e), took)) = &got[1].bytes else {
            unreachable!()
        };
        assert!(e.to_string().contains("hung while reading"), "{e}");
        assert!(*took >= Duration::from_millis(200));
        assert!(matches!(feed.next(Duration::from_millis(100)), Next::Done));
    }

    #[test]
    fn worklist_records_become_inputs_and_bad_ones_are_skipped() {
        let mut stream = crate::record::work_record(3, &Source::File("a\nb.jpg".into()));
        stream.extend_from_slice(b"garbage\0");
        stream.extend(crate::record::work_record(4, &Source::Synthetic(9)));
        stream.extend(crate::record::withdraw_record(3));
        let withdrawn = Arc::new(Mutex::new(HashSet::new()));
        let items: Vec<(u64, Source)> =
            worklist(std::io::Cursor::new(stream), withdrawn.clone()).collect();
        assert_eq!(
            items,
            [
                (3, Source::File("a\nb.jpg".into())),
                (4, Source::Synthetic(9))
            ]
        );
        assert_eq!(*withdrawn.lock().unwrap(), HashSet::from([3]));
        // However many come, the withdrawals kept stay bounded.
        let flood: Vec<u8> = (0..MAX_WITHDRAWN as u64 + 500)
            .flat_map(crate::record::withdraw_record)
            .collect();
        let withdrawn = Arc::new(Mutex::new(HashSet::new()));
        assert_eq!(
            worklist(std::io::Cursor::new(flood), withdrawn.clone()).count(),
            0
        );
        assert_eq!(withdrawn.lock().unwrap().len(), MAX_WITHDRAWN);
    }

    #[test]
    fn a_withdrawn_input_is_left_out() {
        let mut feed = Feed::spawn(
            names(&["a.jpg", "b.jpg", "c.jpg"]),
            4,
            Duration::from_secs(60),
            slow_read,
        );
        feed.withdrawn = Arc::new(Mutex::new(HashSet::from([1])));
        let mut got = Vec::new();
        loop {
            match feed.next(Duration::from_secs(5)) {
                Next::Input(it) => got.push(it.index),
                Next::Wait => continue,
                Next::Done => break,
            }
        }
        assert_eq!(got, [0, 2]);
        assert!(feed.withdrawn.lock().unwrap().is_empty());
    }
}
