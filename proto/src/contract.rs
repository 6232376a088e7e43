//! The contracts that cross crates and reach users, defined once here and
//! used by the controller, the shim, the node daemon, twig-store and
//! twig-net alike:
//!
//! - the annotations a pod carries to the shim (through containerd's CRI
//!   plugin) and the controller reads: [`RESTORE_FROM_ANNOTATION`],
//!   [`TEMPLATE_ANNOTATION`], [`CRI_SANDBOX_NAMESPACE_ANNOTATION`],
//!   [`EGRESS_POLICY_ANNOTATION`], [`NETWORK_ANNOTATION`], [`ENVD_ANNOTATION`],
//!   [`ENVD_TOKEN_SHA256_ANNOTATION`], [`RESTORE_ARTIFACT_ANNOTATION`];
//! - a template's build Pod: [`TEMPLATE_BUILD_LABEL`],
//!   [`TEMPLATE_BUILD_CONTAINER`];
//! - the node-store snapshot [`labels`] one crate writes and another reads;
//! - the error codes of the `Twig` and `Node` services and what each means
//!   for the pod ([`ErrorCode`]).

/// Pod annotation naming a pod snapshot of the node store that the pod's
/// VM is restored from (its containers adopted running). Only the
/// controller sets it (a Clone's pods; the chart's admission policy
/// refuses it from anyone else), and the shim restores only a snapshot
/// owned by the pod's own namespace.
pub const RESTORE_FROM_ANNOTATION: &str = "twig.dev/restore-from";

/// Pod annotation, with [`RESTORE_FROM_ANNOTATION`], naming where the
/// snapshot was exported: `registry/repository@sha256:<digest>` (a
/// Snapshot's `status.artifact.reference`). A node whose store lacks the
/// restore-from snapshot pulls it from there first (the node's
/// `ImportSnapshot`, for the pod's namespace: the repository must be
/// `<prefix>/<namespace>/<name>` and the snapshot the namespace's), so a
/// Clone's pods may run on any node. Only the controller sets it, as it
/// does restore-from.
pub const RESTORE_ARTIFACT_ANNOTATION: &str = "twig.dev/restore-artifact";

/// Pod annotation naming a SandboxTemplate of the pod's namespace whose
/// snapshot the pod's VM is restored from instead of the node's base
/// template. `twig.dev/restore-from` wins over it.
pub const TEMPLATE_ANNOTATION: &str = "twig.dev/template";

/// CRI's annotation of the pod's Kubernetes namespace on every container's
/// OCI spec (containerd's CRI plugin sets it): the namespace that owns the
/// pod's snapshots and the only one whose snapshots the pod may restore.
pub const CRI_SANDBOX_NAMESPACE_ANNOTATION: &str = "io.kubernetes.cri.sandbox-namespace";

/// Pod annotation holding the pod's own egress policy (JSON, twig-net's
/// `EgressPolicy`). It can only narrow the policy its SandboxTemplate (or,
/// without one, the cluster's default) allows: twig-net's
/// `bounded_policy` is what a pod runs with.
pub const EGRESS_POLICY_ANNOTATION: &str = "twig.dev/egress-policy";

/// Pod annotation choosing the pod's VM network. Its one value,
/// [`NETWORK_NONE`], gives the VM no network interface at all (loopback
/// only), whatever CRI set up: an offline sandbox, and the only way a pod
/// on the node's network (`hostNetwork: true`, which a VM cannot honour:
/// its kernel has its own network stack) runs on the twig runtime.
/// Without it a pod's VM joins the pod's network.
pub const NETWORK_ANNOTATION: &str = "twig.dev/network";

/// [`NETWORK_ANNOTATION`]'s value for a VM without network.
pub const NETWORK_NONE: &str = "none";

/// Pod annotation switching the pod's sandbox API on: with the value
/// [`ENVD_ON`], twig-agent serves an E2B-compatible envd (TCP port
/// [`ENVD_PORT`] in the pod's network) for the pod; without it, or with
/// [`ENVD_OFF`], none listens (any other value is refused). It runs
/// commands in the pod's containers, so it is opt-in: twig-api sets it on
/// the pods it makes. CRI passes it with `pod_annotations = ["twig.dev/*"]`;
/// the agent reads it from the sandbox container's OCI spec, and a VM
/// restored from a snapshot gets its pod's value in `Reidentify` (its
/// listener, in guest memory, is started or stopped to match).
pub const ENVD_ANNOTATION: &str = "twig.dev/envd";

/// [`ENVD_ANNOTATION`]'s value for a pod with the sandbox API.
pub const ENVD_ON: &str = "true";

/// [`ENVD_ANNOTATION`]'s value for a pod without the sandbox API.
pub const ENVD_OFF: &str = "false";

/// Pod annotation with the SHA-256 (64 hex digits) of the access token
/// envd requires from the pod's first request on (`X-Access-Token`).
/// Without it, envd serves without a token until `/init` sets one — so a
/// pod reachable by others before its owner calls `/init` needs it.
pub const ENVD_TOKEN_SHA256_ANNOTATION: &str = "twig.dev/envd-token-sha256";

/// A pod's sandbox API, as its annotations ask for it (on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvdPolicy {
    /// The SHA-256 of the access token required from the first request;
    /// `None`: no token until `/init` sets one.
    pub token_sha256: Option<[u8; 32]>,
}

/// What a pod's annotations ask of envd: `None` for none. `annotation`
/// looks a pod annotation up. A value other than [`ENVD_ON`]/[`ENVD_OFF`],
/// or a digest that is not 64 hex digits, is an error naming the
/// annotation.
pub fn envd_policy<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
) -> Result<Option<EnvdPolicy>, String> {
    match annotation(ENVD_ANNOTATION) {
        None | Some(ENVD_OFF) => return Ok(None),
        Some(ENVD_ON) => {}
        Some(other) => {
            return Err(format!(
                "annotation {ENVD_ANNOTATION}: {other:?} is neither {ENVD_ON:?} nor {ENVD_OFF:?}"
            ))
        }
    }
    let Some(hex) = annotation(ENVD_TOKEN_SHA256_ANNOTATION) else {
        return Ok(Some(EnvdPolicy { token_sha256: None }));
    };
    let bad = || format!("annotation {ENVD_TOKEN_SHA256_ANNOTATION}: {hex:?} is not 64 hex digits");
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(Some(EnvdPolicy {
        token_sha256: Some(digest),
    }))
}

/// The TCP port of the sandbox API in the pod's network: E2B's envd port,
/// which the E2B and CubeSandbox SDKs use.
pub const ENVD_PORT: u16 = 49983;

/// Label of a template's build Pod, naming its SandboxTemplate (of the
/// Pod's namespace, which also controls the Pod). The controller of the
/// node makes such a Pod when the node store lacks the template; the
/// chart's admission policy lets a node's controller make only such Pods
/// and a Clone's, and delete only such Pods of its own node.
pub const TEMPLATE_BUILD_LABEL: &str = "twig.dev/template-build";

/// The one container of a template's build Pod: what the template runs,
/// the container the node daemon warms up and whose process a pod restored
/// from the template adopts.
pub const TEMPLATE_BUILD_CONTAINER: &str = "template";

/// Labels of a snapshot in the node store that cross crates: written by one
/// and read by another. A label the shim owns is refused in a `Snapshot`
/// request's own labels.
pub mod labels {
    /// The sandbox (containerd's sandbox id, the shim's group) a pod
    /// snapshot was taken of. Written by the shim's `Snapshot`; read by its
    /// `Rollback` (only a snapshot of the same sandbox is a rollback target)
    /// and by restore-from (the sandbox container to stand in for).
    pub const SANDBOX: &str = "twig.dev/sandbox-id";

    /// The pod's containers when a snapshot was taken: a JSON array of
    /// `{id, name?, slot?, running, guest_id?, pid?}` (the shim's
    /// `SnapshotContainer`). Written by the shim's `Snapshot`; read by its
    /// `Rollback` (the containers must be the same) and by restore-from
    /// (which containers to adopt, on which disk slots). Without it a
    /// snapshot is not a pod snapshot.
    pub const CONTAINERS: &str = "twig.dev/containers";

    /// The SandboxTemplate (`namespace/name`) an app template's snapshot
    /// was built for. Written by the node daemon's template build.
    pub const TEMPLATE: &str = "twig.dev/template";

    /// The digest of what an app template was built from (image, command,
    /// warm-up). Written by the node daemon's build (through the `Snapshot`
    /// request's labels) and read back by it to know whether the build is
    /// current.
    pub const TEMPLATE_SPEC: &str = "twig.dev/template-spec";

    /// An app template's egress policy (JSON, twig-net's `EgressPolicy`),
    /// the bound of its pods' policies. Kept current by the node daemon
    /// (`EnsureTemplate`); read by the shim when a pod is restored from the
    /// template.
    pub const TEMPLATE_EGRESS_POLICY: &str = "twig.dev/egress-policy";
}

/// What a failed call of the `Twig` service (the shim) or the `Node`
/// service (the node daemon) means, by its ttrpc (gRPC) status code. The
/// services answer only these codes, and a caller acts on the code, never
/// on the message (which is for people):
///
/// | code | [`ErrorCode`] | meaning | the pod | the controller |
/// |---|---|---|---|---|
/// | 3 `INVALID_ARGUMENT` | `InvalidArgument` | the request is malformed: an empty id, a label the shim owns, an egress policy that is not one | unchanged | fails the object, `InvalidRequest` |
/// | 4 `DEADLINE_EXCEEDED` | `DeadlineExceeded` | the call waited past its deadline behind the pod's other snapshot or rollback, or the guest's agent did not answer in time | unchanged, or the operation finishes later (the calls are idempotent on their ids) | retries |
/// | 5 `NOT_FOUND` | `NotFound` | no such sandbox on this shim (the pod's sandbox was replaced), snapshot in the node store, template or method | unchanged | fails the object, `NotFound` |
/// | 6 `ALREADY_EXISTS` | `AlreadyExists` | a snapshot of that id exists and is not this pod's | unchanged | fails the object, `AlreadyExists` |
/// | 7 `PERMISSION_DENIED` | `PermissionDenied` | the snapshot belongs to another namespace than the pod's | unchanged | fails the object, `Forbidden` |
/// | 8 `RESOURCE_EXHAUSTED` | `ResourceExhausted` | the node store's filesystem is full; nothing was published | unchanged | fails the object, `NodeStoreFull` |
/// | 9 `FAILED_PRECONDITION` | `FailedPrecondition` | the pod or snapshot is not in a state for it: no VM yet, a rollback target taken of another sandbox or with other containers, an incremental snapshot with no published parent, a stopped guest, no network path | unchanged | fails the object, `PreconditionFailed` |
/// | 10 `ABORTED` | `Aborted` | refused (twig-vmm's `refused`): nothing changed | **runs on, on its state from before the call** | fails the object, `RollbackRefused` / `SnapshotRefused` |
/// | 12 `UNIMPLEMENTED` | `Unimplemented` | the service does not serve this method (an older shim or node) | unchanged | fails the object, `Unimplemented` |
/// | 13 `INTERNAL` | `Internal` | anything else | unknown | fails the object, `ShimError` |
/// | 14 `UNAVAILABLE` | `Unavailable` | busy (the VMM or the store's lock), the guest is not answering, or the service is not there | unchanged | retries |
/// | 15 `DATA_LOSS` | `DataLoss` | the pod's VM is lost (twig-vmm's `lost`): stopped, not to be trusted | **every task of the pod is reported exited** | fails the object, `PodLost` |
///
/// Any other code is read as `INTERNAL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `INVALID_ARGUMENT`: the request is malformed.
    InvalidArgument,
    /// `DEADLINE_EXCEEDED`: waited past the call's deadline; ask again.
    DeadlineExceeded,
    /// `NOT_FOUND`: no such sandbox, snapshot, template or method.
    NotFound,
    /// `ALREADY_EXISTS`: the id is taken by something else.
    AlreadyExists,
    /// `PERMISSION_DENIED`: the snapshot belongs to another namespace.
    PermissionDenied,
    /// `RESOURCE_EXHAUSTED`: the node store's filesystem is full.
    ResourceExhausted,
    /// `FAILED_PRECONDITION`: the pod or snapshot is not in a state for it.
    FailedPrecondition,
    /// `ABORTED`: refused; the pod runs on, on its state from before.
    Aborted,
    /// `UNIMPLEMENTED`: the method is not served.
    Unimplemented,
    /// `INTERNAL`: anything else (and any code not listed here).
    Internal,
    /// `UNAVAILABLE`: busy, the guest not answering, or the service gone;
    /// ask again.
    Unavailable,
    /// `DATA_LOSS`: the pod's VM is lost; every task exited.
    DataLoss,
}

impl ErrorCode {
    /// Every code, in the order of their numbers.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::InvalidArgument,
        ErrorCode::DeadlineExceeded,
        ErrorCode::NotFound,
        ErrorCode::AlreadyExists,
        ErrorCode::PermissionDenied,
        ErrorCode::ResourceExhausted,
        ErrorCode::FailedPrecondition,
        ErrorCode::Aborted,
        ErrorCode::Unimplemented,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
        ErrorCode::DataLoss,
    ];

    /// The gRPC status code's number (as in `google.rpc.Code` and ttrpc's
    /// `Code`).
    pub const fn number(self) -> i32 {
        match self {
            ErrorCode::InvalidArgument => 3,
            ErrorCode::DeadlineExceeded => 4,
            ErrorCode::NotFound => 5,
            ErrorCode::AlreadyExists => 6,
            ErrorCode::PermissionDenied => 7,
            ErrorCode::ResourceExhausted => 8,
            ErrorCode::FailedPrecondition => 9,
            ErrorCode::Aborted => 10,
            ErrorCode::Unimplemented => 12,
            ErrorCode::Internal => 13,
            ErrorCode::Unavailable => 14,
            ErrorCode::DataLoss => 15,
        }
    }

    /// What a failed call's status code means; `None` for `OK` (0), any
    /// other code not in the table is [`ErrorCode::Internal`].
    pub fn from_number(number: i32) -> Option<ErrorCode> {
        if number == 0 {
            return None;
        }
        Some(
            ErrorCode::ALL
                .into_iter()
                .find(|c| c.number() == number)
                .unwrap_or(ErrorCode::Internal),
        )
    }

    /// Whether the same call may succeed later with nothing else changed:
    /// `DEADLINE_EXCEEDED` and `UNAVAILABLE`. `Snapshot` and `Rollback` are
    /// idempotent on their ids, so asking again never does the work twice.
    pub const fn is_retryable(self) -> bool {
        matches!(self, ErrorCode::DeadlineExceeded | ErrorCode::Unavailable)
    }
}

#[cfg(any(feature = "sync", feature = "async"))]
impl From<ErrorCode> for ttrpc::Code {
    fn from(code: ErrorCode) -> ttrpc::Code {
        match code {
            ErrorCode::InvalidArgument => ttrpc::Code::INVALID_ARGUMENT,
            ErrorCode::DeadlineExceeded => ttrpc::Code::DEADLINE_EXCEEDED,
            ErrorCode::NotFound => ttrpc::Code::NOT_FOUND,
            ErrorCode::AlreadyExists => ttrpc::Code::ALREADY_EXISTS,
            ErrorCode::PermissionDenied => ttrpc::Code::PERMISSION_DENIED,
            ErrorCode::ResourceExhausted => ttrpc::Code::RESOURCE_EXHAUSTED,
            ErrorCode::FailedPrecondition => ttrpc::Code::FAILED_PRECONDITION,
            ErrorCode::Aborted => ttrpc::Code::ABORTED,
            ErrorCode::Unimplemented => ttrpc::Code::UNIMPLEMENTED,
            ErrorCode::Internal => ttrpc::Code::INTERNAL,
            ErrorCode::Unavailable => ttrpc::Code::UNAVAILABLE,
            ErrorCode::DataLoss => ttrpc::Code::DATA_LOSS,
        }
    }
}

#[cfg(any(feature = "sync", feature = "async"))]
impl ErrorCode {
    /// The meaning of a ttrpc status (`None` for `OK`).
    pub fn of_status(status: &ttrpc::Status) -> Option<ErrorCode> {
        ErrorCode::from_number(status.code.value())
    }

    /// A ttrpc error answer with this code and `message`.
    pub fn status(self, message: impl ToString) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(self.into(), message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grpcs_and_round_trip() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_number(code.number()), Some(code));
            assert_eq!(ttrpc::Code::from(code) as i32, code.number(), "{code:?}");
        }
        assert_eq!(ErrorCode::from_number(0), None, "OK is no error");
        for unlisted in [1, 2, 11, 16, 99, -1] {
            assert_eq!(ErrorCode::from_number(unlisted), Some(ErrorCode::Internal));
        }
        let retryable: Vec<_> = ErrorCode::ALL
            .into_iter()
            .filter(|c| c.is_retryable())
            .collect();
        assert_eq!(
            retryable,
            [ErrorCode::DeadlineExceeded, ErrorCode::Unavailable]
        );
    }

    #[test]
    fn envd_is_opt_in_and_its_token_digest_is_checked() {
        fn of(pairs: &[(&str, &str)]) -> Result<Option<EnvdPolicy>, String> {
            envd_policy(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v))
        }
        assert_eq!(of(&[]), Ok(None));
        assert_eq!(of(&[(ENVD_ANNOTATION, "false")]), Ok(None));
        assert_eq!(
            of(&[(ENVD_ANNOTATION, "true")]),
            Ok(Some(EnvdPolicy { token_sha256: None }))
        );
        let hex = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let on = of(&[
            (ENVD_ANNOTATION, "true"),
            (ENVD_TOKEN_SHA256_ANNOTATION, hex),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(on.token_sha256.unwrap()[..2], [0x9f, 0x86]);
        assert_eq!(on.token_sha256.unwrap()[31], 0x08);
        // A digest alone turns nothing on.
        assert_eq!(of(&[(ENVD_TOKEN_SHA256_ANNOTATION, hex)]), Ok(None));
        for bad in [
            &[(ENVD_ANNOTATION, "yes")][..],
            &[(ENVD_ANNOTATION, "True")],
            &[
                (ENVD_ANNOTATION, "true"),
                (ENVD_TOKEN_SHA256_ANNOTATION, "abc"),
            ],
            &[
                (ENVD_ANNOTATION, "true"),
                (
                    ENVD_TOKEN_SHA256_ANNOTATION,
                    "zz86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                ),
            ],
            &[
                (ENVD_ANNOTATION, "true"),
                (
                    ENVD_TOKEN_SHA256_ANNOTATION,
                    "é6d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                ),
            ],
        ] {
            let e = of(bad).unwrap_err();
            assert!(e.contains("annotation twig.dev/envd"), "{e}");
        }
    }

    #[test]
    fn a_status_reads_back_as_its_code() {
        for code in ErrorCode::ALL {
            match code.status("m") {
                ttrpc::Error::RpcStatus(s) => {
                    assert_eq!(ErrorCode::of_status(&s), Some(code));
                    assert_eq!(s.message, "m");
                }
                other => panic!("not a status: {other:?}"),
            }
        }
    }
}
