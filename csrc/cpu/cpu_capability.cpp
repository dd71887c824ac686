// PLACEHOLDER: runtime CPU capability selection.
