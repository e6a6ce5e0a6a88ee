//! A producer's inputs: listed from a folder, counted out as synthetic images, or read from a
//! worklist on stdin, with their files read ahead on a thread of their own, so file reads
//! overlap the preprocessing and results keep flowing while the producer waits for more work.

use std::io::BufRead;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tensorport_vision::Source;

use crate::config::Inputs;
use crate::error::{Error, Result};

/// One input, with its file's bytes read ahead.
pub struct Input {
    /// Its position in the input list (also its request id).
    pub index: u64,
    pub source: Source,
    /// The file's bytes (or why they could not be read) and how long the read took; `None` for
    /// a synthetic image.
    pub bytes: Option<(tensorport_vision::Result<Vec<u8>>, Duration)>,
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
}

impl Feed {
    /// Starts the thread that lists (or reads from stdin) the inputs and reads their files, up
    /// to `ahead` inputs ahead of the producer.
    pub fn start(inputs: &Inputs, ahead: usize) -> Result<Feed> {
        let items: Option<Box<dyn Iterator<Item = (u64, Source)> + Send>> = match inputs {
            Inputs::Dir(dir) => Some(Box::new(
                tensorport_vision::list_images(dir)
                    .map_err(Error::Inputs)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| (i as u64, Source::File(p))),
            )),
            // Lazy: the count may be huge (the soak test runs producers that never finish).
            &Inputs::Synthetic(n) => Some(Box::new((0..n).map(|i| (i, Source::Synthetic(i))))),
            Inputs::Worklist => None,
        };
        let (tx, rx) = mpsc::sync_channel::<Input>(ahead.max(1));
        let (spent, reuse) = mpsc::channel::<Vec<u8>>();
        let fill = move |index: u64, source: Source| {
            let bytes = read_ahead(&source, reuse.try_recv().unwrap_or_default());
            Input {
                index,
                source,
                bytes,
            }
        };
        match items {
            Some(list) => {
                std::thread::spawn(move || {
                    for (i, s) in list {
                        if tx.send(fill(i, s)).is_err() {
                            break;
                        }
                    }
                });
            }
            None => {
                std::thread::spawn(move || {
                    for line in std::io::stdin().lock().lines() {
                        let Ok(line) = line else { break };
                        match crate::record::parse_work_line(&line) {
                            Ok((i, s)) => {
                                if tx.send(fill(i, s)).is_err() {
                                    break;
                                }
                            }
                            Err(why) => {
                                tracing::warn!("ignoring worklist line with {why}: {line:?}")
                            }
                        }
                    }
                });
            }
        }
        Ok(Feed { rx, spent })
    }

    /// The next input: waits up to `wait` for one (not at all for a zero wait).
    pub fn next(&self, wait: Duration) -> Next {
        if wait.is_zero() {
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
        }
    }

    /// Gives a read buffer back for the next file.
    pub fn reuse(&self, buf: Vec<u8>) {
        let _ = self.spent.send(buf);
    }
}

/// Reads a file's bytes into `buf` (reused), timing it.
pub fn read_ahead(
    src: &Source,
    mut buf: Vec<u8>,
) -> Option<(tensorport_vision::Result<Vec<u8>>, Duration)> {
    let Source::File(path) = src else {
        return None;
    };
    let t = Instant::now();
    let r = tensorport_vision::read_file(path, &mut buf).map(|()| buf);
    Some((r, t.elapsed()))
}
