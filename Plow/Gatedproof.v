(** * Proofs for [Plow.Gated]: fine gates never open the two-stage barrier
    later than coarse ones, and exactly as early when [latest_gated] holds. *)
From Coq Require Import List Arith Bool Lia.
Import ListNotations.
From Plow Require Import Collapse Gated.

Lemma maxl_map_le {A} (g : A -> nat) (l : list A) b :
  (forall x, In x l -> g x <= b) -> maxl (map g l) <= b.
Proof.
  intros H. apply maxl_le. intros y Hy. apply in_map_iff in Hy as [x [<- Hx]]. auto.
Qed.

(** Fine gates never open the barrier later than coarse gates. *)
Theorem fine_barrier_le_coarse f c P :
  gates_in_range f c P -> fine_barrier f c P <= coarse_barrier f c.
Proof.
  intros [_ Hr]. unfold fine_barrier, coarse_barrier.
  apply maxl_map_le. intros [cj pj] Hin. simpl.
  pose proof (in_combine_l _ _ _ _ Hin) as Hc.
  pose proof (in_combine_r _ _ _ _ Hin) as Hp.
  assert (maxl (map (fun k => nth k f 0) pj) <= maxl f).
  { apply maxl_map_le. intros k Hk. apply maxl_ge, nth_In. exact (Hr pj k Hp Hk). }
  assert (cj <= maxl c) by (apply maxl_ge; exact Hc).
  lia.
Qed.

(** C7r: when a costliest consumer waits on a latest producer, fine gates open
    the barrier at the same instant as coarse gates. *)
Theorem latest_gated_sound f c P :
  gates_in_range f c P -> latest_gated f c P = true ->
  fine_barrier f c P = coarse_barrier f c.
Proof.
  intros Hg Hl. apply Nat.le_antisymm; [apply fine_barrier_le_coarse; exact Hg|].
  unfold latest_gated in Hl. apply existsb_exists in Hl as [[cj pj] [Hin Hx]].
  simpl in Hx. apply andb_true_iff in Hx as [Hc Hk].
  apply Nat.eqb_eq in Hc. apply existsb_exists in Hk as [k [Hk Hf]].
  apply Nat.eqb_eq in Hf.
  unfold fine_barrier, coarse_barrier.
  transitivity (maxl (map (fun k => nth k f 0) pj) + cj).
  - assert (nth k f 0 <= maxl (map (fun k => nth k f 0) pj)).
    { apply maxl_ge. apply in_map_iff. exists k. auto. }
    lia.
  - apply maxl_ge. apply in_map_iff. exists (cj, pj). auto.
Qed.
