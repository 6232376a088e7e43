//! Failpoints: named places where the crate's unit tests inject a failure
//! (rollback's fault-injection tests). They exist only in test builds; in
//! every other build [`check`] is an empty inline function that returns
//! `Ok(())`.
//!
//! Armed failpoints are per thread, so tests running in parallel do not see
//! each other's; a failpoint fires on the thread that calls the operation
//! under test (the VM's own threads never check one). Stalls ([`stall`])
//! are process-wide instead: a test holds one to keep a VM's own thread
//! (a disk's I/O worker) waiting, as slow host I/O would.

use crate::error::Result;

#[cfg(test)]
thread_local! {
    static ARMED: std::cell::RefCell<std::collections::HashSet<&'static str>> =
        std::cell::RefCell::new(std::collections::HashSet::new());
}

/// Makes `name` fail every time it is reached on this thread, until
/// [`disarm_all`].
#[cfg(test)]
pub fn arm(name: &'static str) {
    ARMED.with(|a| a.borrow_mut().insert(name));
}

/// Disarms every failpoint of this thread.
#[cfg(test)]
pub fn disarm_all() {
    ARMED.with(|a| a.borrow_mut().clear());
}

/// Fails with an injected I/O error if a test armed `name`.
#[cfg(test)]
pub fn check(name: &'static str) -> Result<()> {
    if ARMED.with(|a| a.borrow().contains(name)) {
        return Err(crate::error::Error::io(
            format!("failpoint {name}"),
            std::io::Error::other("injected failure"),
        ));
    }
    Ok(())
}

/// Does nothing: failpoints exist only in test builds.
#[cfg(not(test))]
#[inline(always)]
pub fn check(_name: &'static str) -> Result<()> {
    Ok(())
}

/// Stalls: places where any thread (a VM's own included) waits while a test
/// holds them, standing in for slow host I/O.
#[cfg(test)]
#[derive(Default)]
struct Stalls {
    held: Vec<&'static str>,
    /// Threads waiting at a held stall right now.
    waiting: usize,
}

#[cfg(test)]
static STALLS: (std::sync::Mutex<Stalls>, std::sync::Condvar) = (
    std::sync::Mutex::new(Stalls {
        held: Vec::new(),
        waiting: 0,
    }),
    std::sync::Condvar::new(),
);

#[cfg(test)]
fn stalls() -> std::sync::MutexGuard<'static, Stalls> {
    STALLS.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes every thread reaching [`stall`]`(name)` wait until
/// [`release`]`(name)`. Process-wide: one test per name.
#[cfg(test)]
pub fn hold(name: &'static str) {
    stalls().held.push(name);
}

/// Lets the threads held at `name` go on.
#[cfg(test)]
pub fn release(name: &'static str) {
    stalls().held.retain(|n| *n != name);
    STALLS.1.notify_all();
}

/// How many threads wait at a held stall.
#[cfg(test)]
pub fn stalled() -> usize {
    stalls().waiting
}

/// Waits while a test holds `name`.
#[cfg(test)]
pub fn stall(name: &'static str) {
    let mut s = stalls();
    s.waiting += 1;
    while s.held.contains(&name) {
        s = STALLS.1.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    s.waiting -= 1;
}

/// Does nothing: stalls exist only in test builds.
#[cfg(not(test))]
#[inline(always)]
pub fn stall(_name: &'static str) {}
