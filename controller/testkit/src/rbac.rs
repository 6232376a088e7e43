//! What the controller calls on the API server: the chart's ClusterRole must
//! grant exactly this, and the reconciler tests check the controller stays within it.
//! Every node's controller holds it; the chart's `twig-node-restriction`
//! policy bounds each to its own node (pods, finalizer-only patches, deletes).

#![allow(dead_code)]

/// Grants no request exercises: checked by admission, or only on repeats.
pub const NOT_REQUESTED: &[(&str, &str, &str)] = &[
    ("twig.dev", "clones/finalizers", "update"),
    // The event recorder patches an Event only when the same event repeats.
    ("events.k8s.io", "events", "patch"),
    // Only when an object another node holds a finalizer on is deleted (tests/finalizers.rs).
    ("", "nodes", "get"),
    ("", "nodes", "list"),
];

/// (API group, resource, verbs).
pub const CONTROLLER_RULES: &[(&str, &str, &[&str])] = &[
    // Create: a Clone's pods and templates' build pods; delete: build pods
    // (both on its own node only: twig-node-restriction).
    ("", "pods", &["get", "list", "watch", "create", "delete"]),
    // A SandboxTemplate's image pull secrets, by name: its namespace's
    // `default` ServiceAccount's imagePullSecrets, given to the build pod
    // (kubelet reads the Secrets; the controller never does).
    ("", "serviceaccounts", &["get"]),
    // Whether the node of a deleted object's finalizer is gone.
    ("", "nodes", &["get", "list"]),
    ("events.k8s.io", "events", &["create", "patch"]),
    // Finalizers are JSON patches (kube-runtime's helper); status is server-side applied.
    (
        "twig.dev",
        "snapshots",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    ("twig.dev", "snapshots/status", &["patch"]),
    ("twig.dev", "clones", &["get", "list", "watch"]),
    ("twig.dev", "clones/status", &["patch"]),
    // Pods and Snapshots a Clone creates name it with blockOwnerDeletion; the
    // OwnerReferencesPermissionEnforcement admission plugin checks this at create time.
    ("twig.dev", "clones/finalizers", &["update"]),
    ("twig.dev", "rollbacks", &["list", "watch"]),
    ("twig.dev", "rollbacks/status", &["patch"]),
    ("twig.dev", "sandboxtemplates", &["list", "watch", "patch"]),
    ("twig.dev", "sandboxtemplates/status", &["patch"]),
];
