//! A PromQL reader for the subset dashboards use: it follows label names through selectors,
//! aggregations, functions and vector matching, and says which labels an expression's series carry.

use std::collections::BTreeSet;

use crate::{queries::*, tokens::*};

/// What an expression yields: a scalar, or series with these label names; `target`: the series
/// still carry the labels Prometheus adds at scrape time (no aggregation dropped them).
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Scalar,
    Vector {
        labels: BTreeSet<String>,
        target: bool,
    },
}

impl Val {
    pub fn labels(&self) -> BTreeSet<String> {
        match self {
            Val::Scalar => BTreeSet::new(),
            Val::Vector { labels, .. } => labels.clone(),
        }
    }
}

#[rustfmt::skip]
const AGGREGATIONS: [&str; 12] = [
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values",
];

/// Functions that keep their (first) vector argument's labels.
#[rustfmt::skip]
const KEEP_LABELS: [&str; 22] = [
    "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "last_over_time", "abs",
    "ceil", "floor", "round", "sort", "sort_desc", "clamp", "clamp_min", "clamp_max",
];

struct Reader<'a> {
    toks: Vec<Tok>,
    pos: usize,
    pub page: &'a Page,
    /// Families the expression reads.
    pub families: BTreeSet<String>,
}

type R<T> = Result<T, String>;

impl Reader<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    pub fn next(&mut self) -> R<Tok> {
        let t = self.peek().cloned().ok_or("unexpected end")?;
        self.pos += 1;
        Ok(t)
    }

    pub fn expect(&mut self, want: Tok) -> R<()> {
        match self.next()? {
            t if t == want => Ok(()),
            t => Err(format!("expected {want:?}, found {t:?}")),
        }
    }

    fn ident_is(&self, word: &str) -> bool {
        matches!(self.peek(), Some(Tok::Ident(w)) if w == word)
    }

    /// `( a, b, ... )`: label names.
    fn label_list(&mut self) -> R<BTreeSet<String>> {
        self.expect(Tok::Open('('))?;
        let mut out = BTreeSet::new();
        loop {
            match self.next()? {
                Tok::Close(')') => return Ok(out),
                Tok::Comma => {}
                Tok::Ident(l) => {
                    out.insert(l);
                }
                t => return Err(format!("{t:?} in a label list")),
            }
        }
    }

    pub fn expr(&mut self, min_prec: u8) -> R<Val> {
        let mut left = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Tok::Op(op)) => *op,
                Some(Tok::Ident(w)) if ["and", "or", "unless"].contains(&w.as_str()) => {
                    if w == "or" {
                        "or"
                    } else {
                        "and"
                    }
                }
                _ => return Ok(left),
            };
            let prec = match op {
                "or" => 1,
                "and" => 2,
                "==" | "!=" | "<=" | ">=" | "<" | ">" => 3,
                "+" | "-" => 4,
                "*" | "/" | "%" => 5,
                "^" => 6,
                _ => return Err(format!("operator {op}")),
            };
            if prec < min_prec {
                return Ok(left);
            }
            self.pos += 1;
            if self.ident_is("bool") {
                self.pos += 1;
            }
            let mut on = None;
            let mut ignoring = BTreeSet::new();
            if self.ident_is("on") || self.ident_is("ignoring") {
                let is_on = self.ident_is("on");
                self.pos += 1;
                let l = self.label_list()?;
                if is_on {
                    on = Some(l)
                } else {
                    ignoring = l
                }
            }
            let mut group = None;
            if self.ident_is("group_left") || self.ident_is("group_right") {
                let left_side = self.ident_is("group_left");
                self.pos += 1;
                let extra = match self.peek() {
                    Some(Tok::Open('(')) => self.label_list()?,
                    _ => BTreeSet::new(),
                };
                group = Some((left_side, extra));
            }
            let right = self.expr(if op == "^" { prec } else { prec + 1 })?;
            left = binary(op, left, right, on, ignoring, group)?;
        }
    }

    fn unary(&mut self) -> R<Val> {
        if self.peek() == Some(&Tok::Op("-")) {
            self.pos += 1;
        }
        let v = self.primary()?;
        if self.peek() == Some(&Tok::Range) {
            self.pos += 1;
        }
        Ok(v)
    }

    fn primary(&mut self) -> R<Val> {
        match self.next()? {
            Tok::Num | Tok::Str(_) => Ok(Val::Scalar),
            Tok::Open('(') => {
                let v = self.expr(0)?;
                self.expect(Tok::Close(')'))?;
                Ok(v)
            }
            Tok::Ident(name) if AGGREGATIONS.contains(&name.as_str()) => self.aggregation(&name),
            Tok::Ident(name) if self.peek() == Some(&Tok::Open('(')) => self.call(&name),
            Tok::Ident(name) => self.selector(&name),
            t => Err(format!("unexpected {t:?}")),
        }
    }

    /// `sum by (a) (x)`, `sum (x) by (a)`, `topk(5, x)`, ...
    pub fn aggregation(&mut self, name: &str) -> R<Val> {
        let mut clause = self.grouping()?;
        self.expect(Tok::Open('('))?;
        if ["topk", "bottomk", "quantile", "count_values"].contains(&name) {
            self.expr(0)?;
            self.expect(Tok::Comma)?;
        }
        let input = self.expr(0)?;
        self.expect(Tok::Close(')'))?;
        if clause.is_none() {
            clause = self.grouping()?;
        }
        let Val::Vector { labels, target } = input else {
            return Err(format!("{name} of a scalar"));
        };
        if let Some((_, l)) = &clause {
            let missing: Vec<_> = l.difference(&labels).collect();
            if !missing.is_empty() {
                return Err(format!("{name} by/without {missing:?}: not on {labels:?}"));
            }
        }
        Ok(match (name, clause) {
            ("topk" | "bottomk", _) => Val::Vector { labels, target },
            (_, Some((true, by))) => Val::Vector {
                labels: by,
                target: false,
            },
            (_, Some((false, without))) => Val::Vector {
                labels: labels.difference(&without).cloned().collect(),
                target,
            },
            (_, None) => Val::Vector {
                labels: BTreeSet::new(),
                target: false,
            },
        })
    }

    /// `by (...)` (true) or `without (...)` (false), if there.
    fn grouping(&mut self) -> R<Option<(bool, BTreeSet<String>)>> {
        if !(self.ident_is("by") || self.ident_is("without")) {
            return Ok(None);
        }
        let by = self.ident_is("by");
        self.pos += 1;
        Ok(Some((by, self.label_list()?)))
    }

    fn call(&mut self, name: &str) -> R<Val> {
        self.expect(Tok::Open('('))?;
        let mut args = Vec::new();
        let mut strings = Vec::new();
        while self.peek() != Some(&Tok::Close(')')) {
            match self.peek() {
                Some(Tok::Str(s)) => {
                    strings.push(s.clone());
                    self.pos += 1;
                }
                _ => args.push(self.expr(0)?),
            }
            if self.peek() == Some(&Tok::Comma) {
                self.pos += 1;
            }
        }
        self.pos += 1;
        let vector = args.iter().find(|a| **a != Val::Scalar).cloned();
        match name {
            "time" => Ok(Val::Scalar),
            "scalar" => Ok(Val::Scalar),
            "vector" | "absent" => Ok(Val::Vector {
                labels: BTreeSet::new(),
                target: false,
            }),
            "histogram_quantile" => match vector {
                Some(Val::Vector { mut labels, target }) => match labels.remove("le") {
                    true => Ok(Val::Vector { labels, target }),
                    false => Err(format!("histogram_quantile over {labels:?}: no `le`")),
                },
                v => Err(format!("histogram_quantile over {v:?}")),
            },
            "label_replace" => match (vector, strings.as_slice()) {
                (Some(Val::Vector { mut labels, target }), [dst, _, src, _]) => {
                    if !src.is_empty() && !labels.contains(src) {
                        return Err(format!("label_replace from {src}: not on {labels:?}"));
                    }
                    labels.insert(dst.clone());
                    Ok(Val::Vector { labels, target })
                }
                v => Err(format!("label_replace({v:?}, {strings:?})")),
            },
            f if KEEP_LABELS.contains(&f) => vector.ok_or(format!("{f} of no vector")),
            f => Err(format!("function {f} unknown to this test: teach it")),
        }
    }

    /// `name{label op "value", ...}`: the name must be a family of the page (or a histogram's
    /// `_bucket`, `_sum` or `_count`), and each matched label on its samples.
    pub fn selector(&mut self, name: &str) -> R<Val> {
        if !(name.starts_with("rankgate_") || name.starts_with("process_")) {
            return Err(format!("{name}: not one of rankgate's metrics"));
        }
        let family = if self.page.types.contains_key(name) {
            name
        } else {
            ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| name.strip_suffix(s))
                .find(|f| self.page.types.get(*f).is_some_and(|t| t == "histogram"))
                .ok_or(format!("{name}: no such family (# TYPE) on the page"))?
        };
        self.families.insert(family.to_string());
        let labels = (self.page.labels.get(name).cloned()).ok_or(format!(
            "{name}: no samples on the page to check its labels"
        ))?;
        if self.peek() == Some(&Tok::Open('{')) {
            self.pos += 1;
            loop {
                match self.next()? {
                    Tok::Close('}') => break,
                    Tok::Comma => {}
                    Tok::Ident(l) => {
                        if l != "__name__" && !labels.contains(&l) {
                            return Err(format!("{name}{{{l}=...}}: not on {labels:?}"));
                        }
                        match (self.next()?, self.next()?) {
                            (Tok::Op("=" | "!=" | "=~" | "!~"), Tok::Str(_)) => {}
                            t => return Err(format!("matcher {l} {t:?}")),
                        }
                    }
                    t => return Err(format!("{t:?} in a selector")),
                }
            }
        }
        Ok(Val::Vector {
            labels,
            target: true,
        })
    }
}

/// The labels of `left op right`, checking that vector matching joins on labels both sides have
/// (Prometheus' rules: one-to-one keeps the left side's labels, or only the `on` ones;
/// `group_left(x)` adds `x` from the right).
fn binary(
    op: &str,
    left: Val,
    right: Val,
    on: Option<BTreeSet<String>>,
    ignoring: BTreeSet<String>,
    group: Option<(bool, BTreeSet<String>)>,
) -> R<Val> {
    let (l, r) = match (&left, &right) {
        (Val::Scalar, _) => return Ok(right),
        (_, Val::Scalar) => return Ok(left),
        (Val::Vector { labels: l, .. }, Val::Vector { labels: r, .. }) => (l, r),
    };
    let target = |v: &Val| matches!(v, Val::Vector { target: true, .. });
    if op == "or" {
        // Series come from either side: a legend may name what both have.
        let target = target(&left) && target(&right);
        let labels = l.intersection(r).cloned().collect();
        return Ok(Val::Vector { labels, target });
    }
    let key = |side: &BTreeSet<String>| -> R<BTreeSet<String>> {
        match &on {
            Some(on) if !on.is_subset(side) => Err(format!("on {on:?}: not all on {side:?}")),
            Some(on) => Ok(on.clone()),
            None => Ok(side.difference(&ignoring).cloned().collect()),
        }
    };
    let (lk, rk) = (key(l)?, key(r)?);
    // Without `on`, the labels Prometheus adds are part of the match too.
    if lk != rk || (on.is_none() && target(&left) != target(&right)) {
        return Err(format!("{op} matches nothing: {left:?} against {right:?}"));
    }
    Ok(match group {
        // The labels a group modifier copies come from the "one" side.
        Some((left_many, extra)) if !extra.is_subset(if left_many { r } else { l }) => {
            return Err(format!("group_left/right {extra:?}: not on the one side"));
        }
        Some((true, extra)) => Val::Vector {
            labels: l.union(&extra).cloned().collect(),
            target: target(&left),
        },
        Some((false, extra)) => Val::Vector {
            labels: r.union(&extra).cloned().collect(),
            target: target(&right),
        },
        None if on.is_some() && op != "and" => Val::Vector {
            labels: lk,
            target: false,
        },
        None => left,
    })
}

/// Reads `expr` against `page`: the families it uses and what it yields.
pub fn read(expr: &str, page: &Page) -> R<(BTreeSet<String>, Val)> {
    let mut r = Reader {
        toks: tokens(expr)?,
        pos: 0,
        page,
        families: BTreeSet::new(),
    };
    let v = r.expr(0)?;
    match r.peek() {
        None => Ok((r.families, v)),
        Some(t) => Err(format!("{t:?} after the expression")),
    }
}
