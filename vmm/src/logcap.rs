//! The VMM's own log (its stderr, `vmm.log` in twig-node's pool) with a
//! bound. Guest-triggered warnings are rate-limited where they are logged,
//! but nothing else bounds the file: [`Capped`] writes the first `max`
//! bytes of log lines, then one line saying the rest was dropped, then
//! nothing. Keeping the start (not rotating) needs no syscall beyond
//! `write`, which every thread's seccomp filter allows; the bound is a
//! safety net that a healthy VMM never reaches.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The default bound of the VMM's log, bytes (`TWIG_LOG_MAX_BYTES`).
pub const DEFAULT_MAX_BYTES: u64 = 4 << 20;

/// What the log says once it is full.
pub const DROPPED: &[u8] =
    b"twig-vmm: the log reached its bound (TWIG_LOG_MAX_BYTES); later lines are dropped\n";

/// A log target of at most `max` bytes of lines, shared by every thread
/// that logs: `make` gives each write its writer.
#[derive(Clone)]
pub struct Capped<W> {
    target: W,
    /// Bytes still to write; `u64::MAX` once the marker is written.
    left: Arc<AtomicU64>,
}

impl<W: Clone> Capped<W> {
    /// Writes to `target` up to `max` bytes.
    pub fn new(target: W, max: u64) -> Capped<W> {
        Capped {
            target,
            left: Arc::new(AtomicU64::new(max)),
        }
    }

    /// A writer for one log line.
    pub fn make(&self) -> Capped<W> {
        self.clone()
    }
}

impl<W: Write> Write for Capped<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let len = buf.len() as u64;
        let taken = self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                (left != u64::MAX && left >= len).then(|| left - len)
            });
        match taken {
            Ok(_) => self.target.write_all(buf)?,
            // Full: the first writer to find it so says it, once.
            Err(left) if left != u64::MAX => {
                if self.left.swap(u64::MAX, Ordering::AcqRel) != u64::MAX {
                    self.target.write_all(DROPPED)?;
                }
            }
            Err(_) => {}
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.target.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_past_the_bound_are_dropped_after_one_marker() {
        let sink = Sink::default();
        let log = Capped::new(sink.clone(), 100);
        let line = b"a guest-triggered warning, 40 bytes ...\n";
        assert_eq!(line.len(), 40);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        assert_eq!(log.make().write(line).unwrap(), line.len());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let written = sink.0.lock().unwrap().clone();
        let mut expected = line.repeat(2);
        expected.extend_from_slice(DROPPED);
        assert_eq!(written, expected, "two whole lines, then the marker once");
    }

    #[test]
    fn a_line_that_fits_exactly_is_written() {
        let sink = Sink::default();
        let mut log = Capped::new(sink.clone(), 4);
        log.write_all(b"abcd").unwrap();
        log.write_all(b"e").unwrap();
        log.write_all(b"f").unwrap();
        let mut expected = b"abcd".to_vec();
        expected.extend_from_slice(DROPPED);
        assert_eq!(*sink.0.lock().unwrap(), expected);
    }
}
