//! What the controller calls on the API server: the chart's ClusterRole must
//! grant exactly this, and the reconciler tests check the controller stays within it.

#![allow(dead_code)]

/// Grants no request exercises: checked by admission, or only on repeats.
pub const NOT_REQUESTED: &[(&str, &str, &str)] = &[
    ("twig.dev", "clones/finalizers", "update"),
    // The event recorder patches an Event only when the same event repeats.
    ("events.k8s.io", "events", "patch"),
];

/// (API group, resource, verbs).
pub const CONTROLLER_RULES: &[(&str, &str, &[&str])] = &[
    ("", "pods", &["get", "list", "watch", "create"]),
    ("events.k8s.io", "events", &["create", "patch"]),
    (
        "twig.dev",
        "snapshots",
        &["get", "list", "watch", "create", "update", "delete"],
    ),
    ("twig.dev", "snapshots/status", &["update"]),
    ("twig.dev", "clones", &["list", "watch"]),
    ("twig.dev", "clones/status", &["update"]),
    // Pods and Snapshots a Clone creates name it with blockOwnerDeletion; the
    // OwnerReferencesPermissionEnforcement admission plugin checks this at create time.
    ("twig.dev", "clones/finalizers", &["update"]),
    ("twig.dev", "rollbacks", &["list", "watch"]),
    ("twig.dev", "rollbacks/status", &["update"]),
    ("twig.dev", "sandboxtemplates", &["list", "watch", "update"]),
    ("twig.dev", "sandboxtemplates/status", &["update"]),
];
