//! Child processes the harness starts: logged to a file, stopped by PID.

use super::HarnessError;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How often the harness polls while it waits for something.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// A daemon started by the harness; SIGTERM (then SIGKILL) on drop.
pub struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Result<Daemon, HarnessError> {
        let out = fs::File::create(log)
            .map_err(|e| HarnessError::io(format!("creating {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| HarnessError::io(format!("duplicating {}", log.display()), e))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError::io(format!("starting {name} ({cmd:?})"), e))?;
        tracing::debug!(name, pid = child.id(), "started");
        Ok(Daemon {
            name: name.into(),
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `ready` until it holds; fails with the daemon's log if the
    /// daemon exits first or `within` passes.
    pub fn wait_until(
        &mut self,
        what: &str,
        within: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), HarnessError> {
        let deadline = Instant::now() + within;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(HarnessError::Startup {
                        name: self.name.clone(),
                        detail: format!(
                            "exited with {status} before {what}; its log:\n{}",
                            self.log_text()
                        ),
                    });
                }
            }
            if Instant::now() > deadline {
                return Err(HarnessError::Startup {
                    name: self.name.clone(),
                    detail: format!("no {what} after {within:?}; its log:\n{}", self.log_text()),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL; always reaped.
    pub fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: kill(2) on the PID of our own unreaped child, which
            // cannot have been recycled.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(POLL);
        }
        tracing::warn!(name = self.name, "did not exit on SIGTERM; SIGKILL");
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}
