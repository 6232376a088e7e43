//! Failpoints: named places where the crate's unit tests inject a failure
//! (rollback's fault-injection tests). They exist only in test builds; in
//! every other build [`check`] is an empty inline function that returns
//! `Ok(())`.
//!
//! Armed failpoints are per thread, so tests running in parallel do not see
//! each other's; a failpoint fires on the thread that calls the operation
//! under test (the VM's own threads never check one).

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
