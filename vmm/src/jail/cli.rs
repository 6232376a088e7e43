//! The `serve` flags that confine the VMM.
//!
//! `twig-vmm`'s command line is parsed by its `main.rs` (with `lexopt`);
//! the jail's flags are taken here ([`JailArgs::take`]), so their parsing,
//! their checks ([`JailArgs::missing`]) and their help ([`JailArgs::HELP`]) stay
//! next to what they configure.

use std::ffi::OsString;
use std::path::PathBuf;

use super::{seccomp, Bind, CgroupConfig, JailConfig, JailError};

/// Whether `serve` installs its seccomp filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeccompMode {
    /// Filters on every thread; a syscall outside them kills the VMM.
    On,
    /// No filters: for debugging only.
    Off,
}

impl std::str::FromStr for SeccompMode {
    type Err = String;

    fn from_str(s: &str) -> Result<SeccompMode, String> {
        match s {
            "on" => Ok(SeccompMode::On),
            "off" => Ok(SeccompMode::Off),
            _ => Err("  [possible values: on, off]".into()),
        }
    }
}

const JAIL: &str = "--jail <DIR>";
const UID: &str = "--uid <UID>";
const GID: &str = "--gid <GID>";
const CGROUP: &str = "--cgroup <CGROUP>";

/// How `twig-vmm serve` is confined (its flags, [`JailArgs::HELP`]).
#[derive(Debug, Clone)]
pub struct JailArgs {
    /// Seccomp filters per thread (`off` is for debugging only).
    pub seccomp: SeccompMode,
    /// Run inside this directory as `/` (own mount namespace): every path
    /// the VMM is given (`--api-sock`, `--disk`, `--vsock-uds`, `--serial`,
    /// API requests) is then a path inside it. Needs root to start; the VMM
    /// then runs as `--uid`/`--gid` with no capabilities.
    pub jail: Option<PathBuf>,
    /// The jailed VMM's user id (not 0).
    pub uid: Option<u32>,
    /// The jailed VMM's group id (not 0).
    pub gid: Option<u32>,
    /// Bind a host path into the jail, `SOURCE[:TARGET][:ro]` (TARGET
    /// defaults to SOURCE). Repeatable: snapshot stores, disk images.
    pub binds: Vec<Bind>,
    /// The network namespace to join (where the pod's tap lives, e.g.
    /// /var/run/netns/pod); without it the jail gets a new, empty one.
    pub netns: Option<PathBuf>,
    /// Run in this cgroup (relative, created in every hierarchy, v1 and v2).
    pub cgroup: Option<PathBuf>,
    /// A cgroup setting `FILE=VALUE` (e.g. `pids.max=64`), repeatable.
    pub cgroup_settings: Vec<(String, String)>,
    /// Run as PID 1 of a new PID namespace; the process started stays as
    /// its parent and exits the way the VMM did.
    pub new_pid_ns: bool,
    /// The jailed VMM's open file limit (RLIMIT_NOFILE).
    pub max_files: u64,
    /// The flags given, as shown in messages (`--uid <UID>`), in order.
    given: Vec<&'static str>,
}

impl Default for JailArgs {
    /// No flags: seccomp on, no jail.
    fn default() -> JailArgs {
        JailArgs {
            seccomp: SeccompMode::On,
            jail: None,
            uid: None,
            gid: None,
            binds: Vec::new(),
            netns: None,
            cgroup: None,
            cgroup_settings: Vec::new(),
            new_pid_ns: false,
            max_files: 1024,
            given: Vec::new(),
        }
    }
}

fn parse_setting(s: &str) -> Result<(String, String), String> {
    let (file, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not FILE=VALUE"))?;
    if file.is_empty() || file.contains('/') || !file.contains('.') {
        return Err(format!("{file:?} is not a cgroup file name like pids.max"));
    }
    Ok((file.to_string(), value.to_string()))
}

/// `value` as UTF-8, parsed by `parse`; errors worded as clap worded them.
fn parsed<T>(
    flag: &str,
    value: OsString,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, String> {
    let s = value
        .to_str()
        .ok_or_else(|| format!("invalid UTF-8 was detected in the value of '{flag}'"))?;
    parse(s).map_err(|e| {
        if e.starts_with("  [") {
            format!("invalid value '{s}' for '{flag}'\n{e}")
        } else {
            format!("invalid value '{s}' for '{flag}': {e}")
        }
    })
}

fn number<T: std::str::FromStr<Err = std::num::ParseIntError>>(s: &str) -> Result<T, String> {
    s.parse()
        .map_err(|e: std::num::ParseIntError| e.to_string())
}

impl JailArgs {
    /// The jail's flags in `twig-vmm serve --help` (after the VMM's own).
    pub const HELP: &'static str = "      --seccomp <SECCOMP>
          Seccomp filters per thread (`off` is for debugging only)

          Possible values:
          - on:  Filters on every thread; a syscall outside them kills the VMM
          - off: No filters: for debugging only
          
          [default: on]

      --jail <DIR>
          Run inside this directory as `/` (own mount namespace): every path the VMM is given (`--api-sock`, `--disk`, `--vsock-uds`, `--serial`, API requests) is then a path inside it. Needs root to start; the VMM then runs as `--uid`/`--gid` with no capabilities

      --uid <UID>
          The jailed VMM's user id (not 0)

      --gid <GID>
          The jailed VMM's group id (not 0)

      --jail-bind <SRC[:DST][:ro]>
          Bind a host path into the jail, `SOURCE[:TARGET][:ro]` (TARGET defaults to SOURCE). Repeatable: snapshot stores, disk images

      --netns <NETNS>
          The network namespace to join (where the pod's tap lives, e.g. /var/run/netns/pod); without it the jail gets a new, empty one

      --cgroup <CGROUP>
          Run in this cgroup (relative, created in every hierarchy, v1 and v2)

      --cgroup-set <FILE=VALUE>
          A cgroup setting `FILE=VALUE` (e.g. `pids.max=64`), repeatable

      --new-pid-ns
          Run as PID 1 of a new PID namespace; the process started stays as its parent and exits the way the VMM did

      --max-files <MAX_FILES>
          The jailed VMM's open file limit (RLIMIT_NOFILE)
          
          [default: 1024]
";

    /// Takes the long flag `--<name>` if it is one of the jail's, reading
    /// its value (if it has one) with `value`, which gets the flag as shown
    /// in messages (`--uid <UID>`). `Ok(false)`: not a jail flag. Errors
    /// are messages worded as the command line's other errors.
    pub fn take(
        &mut self,
        name: &str,
        value: &mut dyn FnMut(&'static str) -> Result<OsString, String>,
    ) -> Result<bool, String> {
        let flag = match name {
            "seccomp" => "--seccomp <SECCOMP>",
            "jail" => JAIL,
            "uid" => UID,
            "gid" => GID,
            "jail-bind" => "--jail-bind <SRC[:DST][:ro]>",
            "netns" => "--netns <NETNS>",
            "cgroup" => CGROUP,
            "cgroup-set" => "--cgroup-set <FILE=VALUE>",
            "new-pid-ns" => "--new-pid-ns",
            "max-files" => "--max-files <MAX_FILES>",
            _ => return Ok(false),
        };
        let repeatable = matches!(name, "jail-bind" | "cgroup-set");
        if !repeatable && self.given.contains(&flag) {
            return Err(format!(
                "the argument '{flag}' cannot be used multiple times"
            ));
        }
        self.given.push(flag);
        match name {
            "seccomp" => self.seccomp = parsed(flag, value(flag)?, str::parse)?,
            "jail" => self.jail = Some(value(flag)?.into()),
            "uid" => self.uid = Some(parsed(flag, value(flag)?, number)?),
            "gid" => self.gid = Some(parsed(flag, value(flag)?, number)?),
            "jail-bind" => self.binds.push(parsed(flag, value(flag)?, str::parse)?),
            "netns" => self.netns = Some(value(flag)?.into()),
            "cgroup" => self.cgroup = Some(value(flag)?.into()),
            "cgroup-set" => self
                .cgroup_settings
                .push(parsed(flag, value(flag)?, parse_setting)?),
            "new-pid-ns" => self.new_pid_ns = true,
            _ => self.max_files = parsed(flag, value(flag)?, number)?,
        }
        Ok(true)
    }

    /// The flags that the flags given need and that were not given, as
    /// shown in messages: every jail flag but `--seccomp` needs `--jail`,
    /// `--uid` and `--gid`; `--cgroup-set` needs `--cgroup`.
    pub fn missing(&self) -> Vec<&'static str> {
        let given = |flag| self.given.contains(&flag);
        let mut missing = Vec::new();
        if given("--cgroup-set <FILE=VALUE>") && !given(CGROUP) {
            missing.push(CGROUP);
        }
        if self.given.iter().any(|f| *f != "--seccomp <SECCOMP>") {
            missing.extend([UID, GID, JAIL].into_iter().filter(|f| !given(f)));
        }
        missing
    }

    /// The jail these flags describe, if any; `tun` says whether the VM
    /// uses a tap.
    pub fn config(&self, tun: bool) -> Result<Option<JailConfig>, JailError> {
        let Some(root) = self.jail.clone() else {
            return Ok(None);
        };
        let (Some(uid), Some(gid)) = (self.uid, self.gid) else {
            return Err(JailError::Config("--jail needs --uid and --gid".into()));
        };
        if tun && self.netns.is_none() {
            return Err(JailError::Config(
                "a jailed VMM with --tap needs --netns: the tap lives in the pod's network \
                 namespace, created there beforehand and owned by --uid"
                    .into(),
            ));
        }
        Ok(Some(JailConfig {
            root,
            uid,
            gid,
            netns: self.netns.clone(),
            binds: self.binds.clone(),
            tun,
            cgroup: self.cgroup.clone().map(|name| CgroupConfig {
                name,
                settings: self.cgroup_settings.clone(),
            }),
            new_pid_ns: self.new_pid_ns,
            max_files: self.max_files,
        }))
    }

    /// Enters the jail (if any) and turns the seccomp filters on (if on):
    /// call first thing, while the process has one thread. Afterwards, the
    /// caller confines its own thread with [`seccomp::confine`] once
    /// everything needing broader rights is open.
    pub fn apply(&self, tun: bool) -> Result<(), JailError> {
        if let Some(cfg) = self.config(tun)? {
            super::enter(&cfg)?;
        }
        if self.seccomp == SeccompMode::On {
            seccomp::enable();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<JailArgs, String> {
        let mut j = JailArgs::default();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let name = a.strip_prefix("--").unwrap();
            let mut value = |flag: &'static str| {
                it.next()
                    .map(OsString::from)
                    .ok_or_else(|| format!("a value is required for '{flag}'"))
            };
            assert!(j.take(name, &mut value)?, "{name}");
        }
        Ok(j)
    }

    #[test]
    fn flags_values_and_what_they_need() {
        let j = parse(&[
            "--jail",
            "/j",
            "--uid",
            "1",
            "--gid",
            "2",
            "--jail-bind",
            "/a:/b:ro",
            "--jail-bind",
            "/c",
            "--cgroup",
            "g",
            "--cgroup-set",
            "pids.max=64",
            "--new-pid-ns",
            "--max-files",
            "64",
            "--seccomp",
            "off",
        ])
        .unwrap();
        assert!(j.missing().is_empty());
        assert_eq!(j.seccomp, SeccompMode::Off);
        assert_eq!((j.uid, j.gid, j.max_files), (Some(1), Some(2), 64));
        assert_eq!(j.binds.len(), 2);
        assert!(j.binds[0].read_only && !j.binds[1].read_only);
        assert_eq!(j.cgroup_settings, [("pids.max".into(), "64".into())]);
        assert!(j.new_pid_ns);

        assert!(JailArgs::default().missing().is_empty());
        assert_eq!(
            parse(&["--jail", "/j", "--uid", "1"]).unwrap().missing(),
            [GID]
        );
        assert_eq!(parse(&["--uid", "1"]).unwrap().missing(), [GID, JAIL]);
        assert_eq!(
            parse(&["--cgroup-set", "a.b=1"]).unwrap().missing(),
            [CGROUP, UID, GID, JAIL]
        );
        assert!(parse(&["--seccomp", "off"]).unwrap().missing().is_empty());

        let e = parse(&["--seccomp", "maybe"]).unwrap_err();
        assert_eq!(
            e,
            "invalid value 'maybe' for '--seccomp <SECCOMP>'\n  [possible values: on, off]"
        );
        let e = parse(&["--uid", "x"]).unwrap_err();
        assert!(e.contains("'--uid <UID>': invalid digit"), "{e}");
        let e = parse(&["--uid", "1", "--uid", "2"]).unwrap_err();
        assert!(e.contains("cannot be used multiple times"), "{e}");
        let e = parse(&["--jail-bind", "relative"]).unwrap_err();
        assert!(e.contains("absolute"), "{e}");
        let e = parse(&["--cgroup-set", "a"]).unwrap_err();
        assert!(e.contains("is not FILE=VALUE"), "{e}");
        let e = parse(&["--uid"]).unwrap_err();
        assert!(e.contains("a value is required for '--uid <UID>'"), "{e}");
        let mut j = JailArgs::default();
        assert!(!j.take("tap", &mut |_| unreachable!()).unwrap());
    }
}
