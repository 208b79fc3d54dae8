//! Imports point one way: data at the bottom, wiring on top (docs/architecture.md,
//! "Layers"). Each rule names files and the paths they may never name; a file
//! that imports from a layer above it fails this test with the rule's reason.
//! Comments are not imports: lines that start with `//` are skipped.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

struct Rule {
    /// Files or directories, from the repository's root.
    under: &'static [&'static str],
    /// Files or directories under `under` the rule does not cover.
    except: &'static [&'static str],
    /// Paths these files never name.
    never: &'static [&'static str],
    why: &'static str,
}

const RULES: &[Rule] = &[
    Rule {
        under: &["src"],
        except: &["src/cli", "src/main.rs", "src/config.rs"],
        never: &["crate::cli", "vkd::cli"],
        why: "the daemon never imports the commands a person runs (src/cli); \
              they read what it serves",
    },
    Rule {
        under: &["src/explain"],
        except: &[],
        never: &[
            "crate::pods",
            "crate::kubelet_api",
            "crate::node",
            "crate::cli",
            "crate::topology",
        ],
        why: "the decision log and explain's answers are data: they import nothing \
              of the daemon above them",
    },
    Rule {
        under: &["src/pods/model"],
        except: &[],
        never: &[
            "PodController",
            "tokio",
            "kube::Api",
            "kube::Client",
            "crate::pods::status",
            "super::status",
            "crate::pods::ephemeral",
            "super::ephemeral",
            "crate::pods::eviction",
            "super::eviction",
            "crate::pods::volume_refresh",
            "super::volume_refresh",
            "crate::pods::create",
            "super::create",
            "crate::pods::failure",
            "super::failure",
            "crate::pods::events",
            "super::events",
        ],
        why: "a Pod's record is plain data at the bottom of the Pod layer: no I/O, \
              nothing from the status translation, the steps or the controller above it",
    },
    Rule {
        under: &["src/pods/spec", "src/pods/admission.rs"],
        except: &[],
        never: &[
            "PodController",
            "PodRecord",
            "crate::pods::model",
            "super::model",
        ],
        why: "the spec's translation and the kubelet's admission checks are below the record: \
              the record is built from them, never the other way",
    },
    Rule {
        under: &["src/pods/status", "src/pods/status.rs"],
        except: &[],
        never: &[
            "PodController",
            "tokio",
            "kube::Api",
            "kube::Client",
            "crate::pods::ephemeral",
        ],
        why: "a Pod's status view and patch are pure translation; status_write.rs is the one \
              place that writes, and steps use the view, not the other way",
    },
    Rule {
        under: &[
            "src/pods/create.rs",
            "src/pods/failure.rs",
            "src/pods/deadline.rs",
            "src/pods/image_backoff.rs",
            "src/pods/finalize.rs",
            "src/pods/ephemeral.rs",
            "src/pods/volume_refresh.rs",
            "src/pods/status_write.rs",
            "src/pods/node_fit.rs",
            "src/pods/claims.rs",
            "src/pods/cx.rs",
        ],
        except: &[],
        never: &["PodController", "WorkQueue", "gc_wake", "approved_orphans"],
        why: "a step works with its small context (Cx, src/pods/cx.rs): never the \
              controller, its work queue or its collector",
    },
    Rule {
        under: &["src/dra/devices.rs"],
        except: &[],
        never: &[
            "tokio",
            "kube::Api",
            "kube::Client",
            "crate::pods",
            "super::publish",
            "super::binding",
        ],
        why: "the DRA mapping (host slices to devices, an allocation to a placement) is pure \
              translation that the publisher, the binder and the create step share",
    },
    Rule {
        under: &["src/dra"],
        except: &[],
        never: &["PodController", "PodRecord", "WorkQueue"],
        why: "DRA works with a node's admitter and the Pod as the API has it, never the \
              Pod layer's controller or records",
    },
    Rule {
        under: &["src/kubelet_api", "src/admin.rs"],
        except: &[],
        never: &["PodController"],
        why: "outside the Pod layer, code sees the read-only PodIndex, never the controller",
    },
    Rule {
        under: &[
            "providers/api/src/types.rs",
            "providers/api/src/streams.rs",
            "providers/api/src/error.rs",
        ],
        except: &[],
        never: &["crate::"],
        why: "the provider contract's data, streams and errors are its bottom layer",
    },
    Rule {
        under: &["providers/process/src/procfs.rs"],
        except: &[],
        never: &["crate::"],
        why: "procfs is the process provider's leaf: what the kernel says about a process",
    },
    Rule {
        under: &["providers/sim/src/state.rs"],
        except: &[],
        never: &["crate::"],
        why: "the sim's state is apart from its behaviour",
    },
];

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for p in entries {
            rust_files(&p, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_owned());
    }
}

/// `file`'s lines (1-based) that name one of `never`, outside comments and
/// before its test module (tests build what they test).
fn offences(text: &str, never: &[&str]) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let code = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
        .unwrap_or(lines.len());
    lines[..code]
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter(|(_, l)| never.iter().any(|n| l.contains(n)))
        .map(|(i, l)| (i + 1, l.trim().to_owned()))
        .collect()
}

/// Every offence against `rules` under `root`, as lines a person reads.
fn check(root: &Path, rules: &[Rule]) -> Vec<String> {
    let mut found = Vec::new();
    for rule in rules {
        let mut files = Vec::new();
        for under in rule.under {
            let path = root.join(under);
            assert!(
                path.exists(),
                "a layering rule names {under}, which is gone"
            );
            rust_files(&path, &mut files);
        }
        for file in files {
            let rel = file.strip_prefix(root).unwrap_or(&file);
            if rule.except.iter().any(|e| rel.starts_with(e)) {
                continue;
            }
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            for (line, code) in offences(&text, rule.never) {
                found.push(format!(
                    "{}:{line}: {code}\n    ({})",
                    rel.display(),
                    rule.why
                ));
            }
        }
    }
    found
}

#[test]
fn imports_point_one_way() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let found = check(root, RULES);
    assert!(
        found.is_empty(),
        "imports against the layering:\n{}",
        found.join("\n")
    );
}

#[test]
fn an_import_from_above_is_found_and_a_comment_or_a_test_is_not() {
    let dir = std::env::temp_dir().join(format!("vkd-layering-{}", std::process::id()));
    let src = dir.join("src/explain");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("mod.rs"),
        "//! See [`crate::pods`].\nuse crate::pods::PodRecord;\n\n#[cfg(test)]\nmod tests {\n    use crate::pods::Scripted;\n}\n",
    )
    .unwrap();
    let found = check(&dir, &RULES[1..2]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("src/explain/mod.rs:2: use crate::pods::PodRecord;"));
}
