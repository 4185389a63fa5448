//! Collects mismatches so a check can finish all its communication before failing:
//! returning early would leave the other ranks waiting in a collective.

use std::fmt::Debug;

/// Mismatches found so far on one rank, in the order they were found.
#[derive(Debug, Default)]
pub(super) struct Verdict {
    problems: Vec<String>,
}

impl Verdict {
    /// Records a problem unless `cond` holds.
    pub(super) fn ensure(&mut self, cond: bool, what: impl FnOnce() -> String) {
        if !cond {
            self.problems.push(what());
        }
    }

    /// Compares `got` with `want` element by element; records the first difference.
    pub(super) fn equal<T: PartialEq + Debug>(&mut self, what: &str, got: &[T], want: &[T]) {
        self.close(what, got, want, |a, b| a == b);
    }

    /// Like [`equal`](Self::equal) with a caller-supplied element comparison.
    pub(super) fn close<T: Debug>(
        &mut self,
        what: &str,
        got: &[T],
        want: &[T],
        same: impl Fn(&T, &T) -> bool,
    ) {
        if got.len() != want.len() {
            self.problems.push(format!(
                "{what}: got {} elements, want {}",
                got.len(),
                want.len()
            ));
            return;
        }
        if let Some(i) = got.iter().zip(want).position(|(g, w)| !same(g, w)) {
            self.problems.push(format!(
                "{what}: element {i}: got {:?}, want {:?}",
                got[i], want[i]
            ));
        }
    }

    /// `Ok` when nothing was recorded, else the problems joined with `"; "`.
    pub(super) fn finish(self) -> Result<(), String> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(self.problems.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_first_difference_and_length() {
        let mut v = Verdict::default();
        v.equal("a", &[1, 2, 3], &[1, 2, 3]);
        assert!(Verdict::default().finish().is_ok());
        v.equal("b", &[1, 5, 6], &[1, 2, 3]);
        v.equal("c", &[1], &[1, 2]);
        let want = "b: element 1: got 5, want 2; c: got 1 elements, want 2";
        assert_eq!(v.finish(), Err(want.to_string()));
    }
}
