//! Kubernetes' own e2e specs as vkd's node conformance suite: the committed lists
//! of what runs and what is skipped (and why), the focus expression handed to
//! ginkgo, and the reading of ginkgo's JSON report into the table a person reads.
//!
//! The lists live in `e2e/conformance/`:
//! - `suite.txt`: the spec families taken (`family: <top-level container text>`)
//!   and the markers that leave a spec out of the selection (`exclude: <marker> # why`);
//! - `run.txt`: one full spec text per line, each must pass;
//! - `skip.txt`: `<full spec text> || <reason>`, one per line: what a virtual node
//!   on this backend cannot do;
//! - `defects.txt`: the same form, for specs that fail through a defect of vkd not
//!   fixed yet. They are not run (they would fail the gate) but are shown in the
//!   table, so the gap stays in sight; fixing one moves it to `run.txt`.
//!
//! A family's every selected spec must be in exactly one of the lists, so a
//! spec the next Kubernetes adds is noticed rather than silently not run.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

/// What `suite.txt` selects.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Top-level container texts, e.g. `[sig-node] Pods`.
    pub families: Vec<String>,
    /// Substrings of a spec's full text that leave it out, with the reason.
    pub excludes: Vec<(String, String)>,
}

/// The committed run and skip lists.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Lists {
    pub selection: Selection,
    pub run: Vec<String>,
    /// Spec text and the one-line reason it is skipped.
    pub skip: Vec<(String, String)>,
    /// Spec text and the vkd defect that makes it fail today.
    pub defects: Vec<(String, String)>,
}

fn content_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
}

impl Lists {
    /// Reads `suite.txt`, `run.txt`, `skip.txt` and `defects.txt` from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .with_context(|| format!("reading {}", dir.join(name).display()))
        };
        Self::parse(
            &read("suite.txt")?,
            &read("run.txt")?,
            &read("skip.txt")?,
            &read("defects.txt")?,
        )
    }

    pub fn parse(suite: &str, run: &str, skip: &str, defects: &str) -> Result<Self> {
        let mut lists = Self::default();
        for (n, line) in content_lines(suite) {
            if let Some(family) = line.strip_prefix("family:") {
                lists.selection.families.push(family.trim().to_owned());
            } else if let Some(rest) = line.strip_prefix("exclude:") {
                let (marker, why) = rest
                    .split_once(" # ")
                    .with_context(|| format!("suite.txt:{n}: an exclude needs ` # <reason>`"))?;
                lists
                    .selection
                    .excludes
                    .push((marker.trim().to_owned(), why.trim().to_owned()));
            } else {
                bail!("suite.txt:{n}: expected `family:` or `exclude:`, got {line:?}");
            }
        }
        let mut seen = BTreeSet::new();
        for (n, line) in content_lines(run) {
            ensure!(
                seen.insert(line.to_owned()),
                "run.txt:{n}: listed twice: {line}"
            );
            lists.run.push(line.to_owned());
        }
        lists.skip = reasoned("skip.txt", skip, &mut seen)?;
        lists.defects = reasoned("defects.txt", defects, &mut seen)?;
        Ok(lists)
    }

    /// What is wrong with the lists against the specs the selection finds in the
    /// binary: unlisted specs, and listed ones that do not exist. Empty when right.
    pub fn problems(&self, selected: &BTreeSet<String>) -> Vec<String> {
        let listed: BTreeSet<&str> = self
            .run
            .iter()
            .map(String::as_str)
            .chain(
                self.skip
                    .iter()
                    .chain(&self.defects)
                    .map(|(s, _)| s.as_str()),
            )
            .collect();
        let mut out = Vec::new();
        for s in selected {
            if !listed.contains(s.as_str()) {
                out.push(format!("not in run.txt, skip.txt or defects.txt: {s}"));
            }
        }
        for s in listed {
            if !selected.contains(s) {
                out.push(format!(
                    "listed, but no such selected spec in e2e.test: {s}"
                ));
            }
        }
        out
    }
}

/// Reads `<spec> || <reason>` lines; `seen` holds every spec listed so far.
fn reasoned(file: &str, text: &str, seen: &mut BTreeSet<String>) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (n, line) in content_lines(text) {
        let (spec, why) = line
            .rsplit_once(" || ")
            .with_context(|| format!("{file}:{n}: expected `<spec> || <reason>`"))?;
        let (spec, why) = (spec.trim(), why.trim());
        ensure!(
            !why.is_empty(),
            "{file}:{n}: {spec} is listed with no reason"
        );
        ensure!(
            seen.insert(spec.to_owned()),
            "{file}:{n}: already listed in another line or list: {spec}"
        );
        out.push((spec.to_owned(), why.to_owned()));
    }
    Ok(out)
}

/// Escapes `text` for Go's RE2 syntax (what ginkgo's focus is).
pub fn re2_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A focus that matches exactly these specs. Ginkgo matches a focus against
/// `<suite description> <spec text>`, so each is anchored at both ends.
pub fn exact_focus(suite_description: &str, specs: &[&str]) -> String {
    let alternatives: Vec<String> = specs.iter().map(|s| re2_escape(s)).collect();
    format!(
        "^{} (?:{})$",
        re2_escape(suite_description),
        alternatives.join("|")
    )
}

/// A focus for every spec of these families.
pub fn family_focus(suite_description: &str, families: &[String]) -> String {
    let alternatives: Vec<String> = families.iter().map(|f| re2_escape(f)).collect();
    format!(
        "^{} (?:{}) ",
        re2_escape(suite_description),
        alternatives.join("|")
    )
}

/// One spec's outcome from a ginkgo JSON report.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecResult {
    pub spec: String,
    /// ginkgo's state: passed, failed, skipped, pending, panicked, interrupted, aborted, timedout.
    pub state: String,
    pub seconds: f64,
    /// The failure's message, first lines only.
    pub message: Option<String>,
}

/// The suite description and every It in a ginkgo `--json-report` file.
pub fn read_report(report: &Value) -> Result<(String, Vec<SpecResult>)> {
    let suites = report
        .as_array()
        .context("a ginkgo JSON report is an array of suite reports")?;
    let mut description = String::new();
    let mut out = Vec::new();
    for suite in suites {
        if let Some(d) = suite.get("SuiteDescription").and_then(Value::as_str) {
            description = d.to_owned();
        }
        for s in suite
            .get("SpecReports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if s.get("LeafNodeType").and_then(Value::as_str) != Some("It") {
                continue;
            }
            let mut texts: Vec<&str> = s
                .get("ContainerHierarchyTexts")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .filter(|t| !t.is_empty())
                .collect();
            if let Some(leaf) = s.get("LeafNodeText").and_then(Value::as_str)
                && !leaf.is_empty()
            {
                texts.push(leaf);
            }
            let message = s
                .pointer("/Failure/Message")
                .and_then(Value::as_str)
                .filter(|m| !m.is_empty())
                .map(|m| m.lines().take(6).collect::<Vec<_>>().join("\n"));
            out.push(SpecResult {
                spec: texts.join(" "),
                state: s
                    .get("State")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown")
                    .to_owned(),
                // RunTime is a Go time.Duration: nanoseconds.
                seconds: s.get("RunTime").and_then(Value::as_f64).unwrap_or(0.0) / 1e9,
                message,
            });
        }
    }
    Ok((description, out))
}

/// The specs of the selected families that no exclude marker leaves out.
pub fn select(selection: &Selection, all: &[SpecResult]) -> BTreeSet<String> {
    all.iter()
        .map(|r| r.spec.as_str())
        .filter(|s| {
            selection.families.iter().any(|f| {
                s.strip_prefix(f.as_str())
                    .is_some_and(|r| r.starts_with(' '))
            })
        })
        .filter(|s| {
            !selection
                .excludes
                .iter()
                .any(|(m, _)| s.contains(m.as_str()))
        })
        .map(str::to_owned)
        .collect()
}

/// The verdict on each listed spec: what ginkgo said, or `not run`.
pub fn verdicts<'a>(
    run: &'a [String],
    results: &'a [SpecResult],
) -> Vec<(&'a str, &'a str, f64, Option<&'a str>)> {
    let by_name: BTreeMap<&str, &SpecResult> =
        results.iter().map(|r| (r.spec.as_str(), r)).collect();
    run.iter()
        .map(|s| match by_name.get(s.as_str()) {
            Some(r) => (
                s.as_str(),
                r.state.as_str(),
                r.seconds,
                r.message.as_deref(),
            ),
            None => (s.as_str(), "not run", 0.0, None),
        })
        .collect()
}

/// The table a person reads: spec, result, seconds; then the specs not run, with
/// their reasons.
pub fn table(verdicts: &[(&str, &str, f64, Option<&str>)], lists: &Lists) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<9} {:>8}  spec", "result", "seconds");
    for (spec, state, secs, _) in verdicts {
        let _ = writeln!(out, "{state:<9} {secs:>8.1}  {spec}");
    }
    for (label, list) in [("skipped", &lists.skip), ("defect", &lists.defects)] {
        for (spec, why) in list {
            let _ = writeln!(out, "{label:<9} {:>8}  {spec}  ({why})", "-");
        }
    }
    let passed = verdicts.iter().filter(|v| v.1 == "passed").count();
    let total: f64 = verdicts.iter().map(|v| v.2).sum();
    let _ = writeln!(
        out,
        "{passed} of {} specs run passed; {} skipped, {} not run for a known defect; {total:.0} s of spec time",
        verdicts.len(),
        lists.skip.len(),
        lists.defects.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lists_parse_and_refuse_what_is_ambiguous() {
        let l = Lists::parse(
            "# header\nfamily: [sig-node] Pods\nexclude: [Slow] # over budget\n",
            "[sig-node] Pods should a\n",
            "[sig-node] Pods should b || needs kube-proxy\n",
            "[sig-node] Pods should c || no Event\n",
        )
        .unwrap();
        assert_eq!(l.defects[0].1, "no Event");
        assert_eq!(l.selection.families, ["[sig-node] Pods"]);
        assert_eq!(l.selection.excludes[0].1, "over budget");
        assert_eq!(l.skip[0].1, "needs kube-proxy");
        // Twice, in both lists, no reason, or an unknown line: refused, with the line.
        let e = Lists::parse("", "a\n", "a || why\n", "").unwrap_err();
        assert!(format!("{e}").contains("skip.txt:1"), "{e}");
        let e = Lists::parse("", "", "a || why\n", "a || bug\n").unwrap_err();
        assert!(format!("{e}").contains("defects.txt:1"), "{e}");
        assert!(Lists::parse("", "", "b ||  \n", "").is_err());
        assert!(Lists::parse("", "", "b\n", "").is_err());
        assert!(Lists::parse("families: x\n", "", "", "").is_err());
        assert!(Lists::parse("exclude: [Slow]\n", "", "", "").is_err());
        assert!(Lists::parse("", "a\na\n", "", "").is_err());
    }

    #[test]
    fn problems_name_unlisted_and_unknown_specs() {
        let l = Lists::parse("", "a\n", "b || why\n", "").unwrap();
        let selected: BTreeSet<String> = ["a", "c"].map(String::from).into();
        let p = l.problems(&selected);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].contains("not in run.txt") && p[0].ends_with(": c"));
        assert!(p[1].contains("no such") && p[1].ends_with(": b"));
    }

    #[test]
    fn focus_is_exact_re2() {
        assert_eq!(re2_escape("a.b[c] (d)|e$"), r"a\.b\[c\] \(d\)\|e\$");
        let f = exact_focus("Kubernetes e2e suite", &["[sig-node] Pods x", "y*"]);
        assert_eq!(f, r"^Kubernetes e2e suite (?:\[sig-node\] Pods x|y\*)$");
        let f = family_focus("S", &["[sig-cli] Kubectl logs".into()]);
        assert_eq!(f, r"^S (?:\[sig-cli\] Kubectl logs) ");
    }

    #[test]
    fn report_reads_its_and_selects_families() {
        let report = json!([{
            "SuiteDescription": "Kubernetes e2e suite",
            "SpecReports": [
                {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed"},
                {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-node] Pods", "when x"],
                 "LeafNodeText": "should run", "State": "passed", "RunTime": 2_500_000_000_i64},
                {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-node] Pods Extended"],
                 "LeafNodeText": "should y [Slow]", "State": "failed", "RunTime": 1_000_000_000_i64,
                 "Failure": {"Message": "timed out\nwaiting"}},
                {"LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-node] Pods"],
                 "LeafNodeText": "should z [Slow]", "State": "skipped"},
            ]
        }]);
        let (desc, specs) = read_report(&report).unwrap();
        assert_eq!(desc, "Kubernetes e2e suite");
        assert_eq!(specs.len(), 3);
        assert_eq!(specs[0].spec, "[sig-node] Pods when x should run");
        assert!((specs[0].seconds - 2.5).abs() < 1e-9);
        assert_eq!(specs[1].message.as_deref(), Some("timed out\nwaiting"));
        let sel = Selection {
            families: vec!["[sig-node] Pods".into()],
            excludes: vec![("[Slow]".into(), "budget".into())],
        };
        // "Pods Extended" is another family; the [Slow] one is excluded.
        assert_eq!(
            select(&sel, &specs).into_iter().collect::<Vec<_>>(),
            ["[sig-node] Pods when x should run"]
        );
        assert!(read_report(&json!({})).is_err());
    }

    #[test]
    fn verdicts_mark_specs_that_never_ran() {
        let results = vec![SpecResult {
            spec: "a".into(),
            state: "passed".into(),
            seconds: 1.0,
            message: None,
        }];
        let run = vec!["a".to_owned(), "b".to_owned()];
        let v = verdicts(&run, &results);
        assert_eq!(v[0].1, "passed");
        assert_eq!(v[1].1, "not run");
        let lists = Lists::parse("", "", "c || why\n", "d || bug\n").unwrap();
        let t = table(&v, &lists);
        assert!(
            t.contains("1 of 2 specs run passed; 1 skipped, 1 not run"),
            "{t}"
        );
        assert!(t.contains("skipped          -  c  (why)"), "{t}");
        assert!(t.contains("defect           -  d  (bug)"), "{t}");
    }
}
